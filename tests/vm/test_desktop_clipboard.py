"""The desktop image's pointer and clipboard, in a real guest: the screen's virtio tablet is an input device of the
X session (so the guest's pointer sits under the browser's), and a text made the guest's clipboard through the
guest agent is what the X server hands out (CLIPBOARD and PRIMARY) and what comes back, also once the guest has
been suspended and restored (as a move does)."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from capsule.console import clipboard
from capsule.imagebuild.desktop import USER
from capsule.runtime.guestagent import wait_for_agent
from tests.helpers.guest import run

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_tablet_and_clipboard_in_the_desktop_session(desktop_store):
    store = desktop_store
    capsules.create(store, "desk", "desktop", memory="1G")
    lifecycle.start(store, "desk", timeout=600)
    wait_for_agent(store.instance_dir("desk") / "agent.sock", timeout=60)

    # the tablet: the kernel has it, and the X session took it as a pointer
    assert "QEMU Virtio Tablet" in run(store, "desk", "cat /proc/bus/input/devices")
    xlog = run(store, "desk", f"cat /home/{USER}/.local/share/xorg/Xorg.0.log")
    assert "QEMU Virtio Tablet" in xlog and "XINPUT: Adding extended input device" in xlog

    text = "Grüße ß zy 🙂\nline two"
    assert clipboard.set(store, "desk", text) == len(text.encode())
    assert clipboard.get(store, "desk") == text
    # the helper owns the selections as the session's user, and left no file behind
    assert run(store, "desk", "ls -A /run/capsule-clipboard") == ""
    owner = run(store, "desk", "ps -o user= -C python3").split()
    assert owner == [USER]

    big = "a" * clipboard.MAX_BYTES
    assert clipboard.set(store, "desk", big) == clipboard.MAX_BYTES
    assert clipboard.get(store, "desk") == big
    assert run(store, "desk", "ps -o user= -C python3").split() == [USER]     # the first helper gave way

    lifecycle.suspend(store, "desk")
    assert lifecycle.start(store, "desk").mode == "restore"
    wait_for_agent(store.instance_dir("desk") / "agent.sock", timeout=60)
    assert clipboard.get(store, "desk") == big
