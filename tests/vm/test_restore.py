"""Restoring memory images with this host's own machine: a crafted image is refused before anything is made,
a suspend whose sealing fails brings the guest back from its saved image, and a restored guest's console
answers even if the save cut a line in half."""

from __future__ import annotations

import dataclasses
import os
import time
import xml.etree.ElementTree as ET

import pytest

from capsule import capsules, lifecycle
from capsule.console.serial import ConsoleSession
from capsule.errors import IntegrityError, StorageFull
from capsule.runtime import saveimage
from capsule.runtime.connection import lookup_domain
from tests.helpers.guest import COUNTER, count, run, wait_count_above

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]


def _leaves(store) -> list:
    return sorted(store.layers_dir.glob("leaf-*"))


@pytest.mark.parametrize(("extra", "named"), [
    ("<hostdev mode='subsystem' type='pci'><source><address domain='0x0000' bus='0x00' slot='0x1f' "
     "function='0x0'/></source></hostdev>", "hostdev"),
    ("<filesystem type='mount'><source dir='/'/><target dir='host'/></filesystem>", "filesystem"),
])
def test_crafted_memory_image_is_refused_before_anything_starts(store, extra, named):
    capsules.create(store, "c", "tiny", memory="256M")
    lifecycle.start(store, "c")
    sealed = lifecycle.suspend(store, "c")
    crafted = store.temp_path(".save")

    def add_device(root: ET.Element) -> None:
        root.find("devices").append(ET.fromstring(extra))

    saveimage.rewrite(store.file_path(sealed.memory.id), crafted, add_device)
    row = store.seal_file(crafted, "memory")   # sealed and hashed like any received image
    cat = store.catalogue
    with cat.transaction():
        cat.add_file(row)
        cat.add_version(dataclasses.replace(sealed.version, number=3, memory=row.id, created=time.time()))
    leaves = _leaves(store)
    with pytest.raises(IntegrityError, match=named):
        lifecycle.start(store, "c@3")
    assert lookup_domain(store.domain_name("c")) is None
    assert cat.instance("c") is None
    assert _leaves(store) == leaves
    # the honest version next to it still restores
    assert lifecycle.start(store, "c@2").mode == "restore"


def test_seal_failure_after_the_save_restores_the_guest(store, monkeypatch):
    capsules.create(store, "s", "tiny", memory="256M")
    lifecycle.start(store, "s")
    run(store, "s", COUNTER)
    before = wait_count_above(store, "s", 5)

    def full(*_args, **_kw):
        raise StorageFull("the store's file system is full (simulated)")

    monkeypatch.setattr(type(store), "seal_layer", full)
    with pytest.raises(StorageFull):
        lifecycle.suspend(store, "s")
    monkeypatch.undo()
    assert lookup_domain(store.domain_name("s")) is not None
    assert store.catalogue.latest_version("s").number == 1
    after = count(store, "s")
    assert before <= after < before + 30
    assert wait_count_above(store, "s", after) > after


def test_console_recovers_a_shell_left_inside_an_open_quote(store):
    """A guest saved while its shell had read half a line (the rest is lost with the old pty) is left inside
    an open quote; the next console session must still get a shell."""
    capsules.create(store, "q", "tiny", memory="256M")
    lifecycle.start(store, "q")
    run(store, "q", COUNTER)
    session = ConsoleSession(store.domain_name("q"))
    session.send("echo 'half a line\n")   # the shell now waits for the closing quote
    session.drain(1.0)
    os.close(session.fd)                    # gone without its closing line, like a pty lost in a save
    assert count(store, "q") > 0
