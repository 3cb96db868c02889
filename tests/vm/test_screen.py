"""Every capsule has a screen (a VGA card, a VNC server on a unix socket in its instance directory), and a
memory image saved before capsules had one still restores: without a screen, its device state unchanged."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from capsule import capsules, lifecycle
from capsule.console import screen
from capsule.errors import Conflict
from capsule.lifecycle import memimage
from capsule.runtime.connection import lookup_domain
from tests.helpers.guest import COUNTER, count, run, wait_count_above

pytestmark = pytest.mark.vm


def _rfb_greeting(path) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        return s.recv(12)


def test_screen_on_a_unix_socket_only_and_kept_across_restore(store):
    capsules.create(store, "c1", "tiny", memory="256M")
    lifecycle.start(store, "c1")
    xml = lookup_domain(store.domain_name("c1")).XMLDesc(0)
    assert "<graphics type='vnc' socket=" in xml and "port=" not in xml.split("<graphics")[1].split(">")[0]
    assert "console=tty0 console=ttyS0" in xml            # the kernel writes to the screen too
    sock = screen.vnc_socket(store, "c1")
    assert sock.parent == store.instance_dir("c1")
    assert _rfb_greeting(sock).startswith(b"RFB 003.")
    lifecycle.suspend(store, "c1")
    assert lifecycle.start(store, "c1").mode == "restore"
    assert _rfb_greeting(screen.vnc_socket(store, "c1")).startswith(b"RFB 003.")


def test_image_saved_without_a_screen_restores_without_one(store, monkeypatch):
    plain = memimage.machine_spec

    def without_screen(*args, **kw):
        return dataclasses.replace(plain(*args, **kw), vnc_socket=None)

    # boot and suspend as a host before screens existed did
    capsules.create(store, "old", "tiny", memory="256M")
    monkeypatch.setattr(memimage, "machine_spec", without_screen)
    lifecycle.start(store, "old")
    assert "<video" not in lookup_domain(store.domain_name("old")).XMLDesc(0)
    run(store, "old", COUNTER)
    before = wait_count_above(store, "old", 5)
    lifecycle.suspend(store, "old")
    monkeypatch.setattr(memimage, "machine_spec", plain)

    # this host's template has a screen; the old image restores without it, its guest continues
    assert lifecycle.start(store, "old").mode == "restore"
    xml = lookup_domain(store.domain_name("old")).XMLDesc(0)
    assert "<video" not in xml and "<graphics" not in xml
    assert count(store, "old") >= before
    assert wait_count_above(store, "old", before + 3) > before + 3
    with pytest.raises(Conflict, match="no screen"):
        screen.vnc_socket(store, "old")
