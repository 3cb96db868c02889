"""The desktop image as a capsule: `capsule start` returns once its graphical session is on screen, the
screen shows the session (not the text console), the guest agent and the serial shell work as on the
Debian guest, and the session survives a suspend and restore."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from capsule.console.screen import screenshot
from capsule.imagebuild import DESKTOP_MARKER, MARKER
from capsule.imagebuild.desktop import BACKGROUND, USER
from capsule.runtime.guestagent import wait_for_agent
from tests.helpers.guest import run
from tests.wait import wait_until

# the first test builds the image (about two minutes) unless the test image store has it
pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_desktop_capsule_boots_into_its_graphical_session(desktop_store):
    store = desktop_store
    info = store.catalogue.image("desktop").info
    assert info["kernel_release"].endswith("-amd64") and "cloud" not in info["kernel_release"]
    assert {"xserver-xorg-core", "jwm", "xterm", "dillo"} <= set(info["packages"])

    capsules.create(store, "desk", "desktop", memory="1G")
    booted = lifecycle.start(store, "desk", timeout=600)  # returns at the image's marker: the session is up
    assert booted.mode == "boot"
    log = (store.instance_dir("desk") / "console.log").read_text(errors="replace")
    assert log.index(MARKER) < log.index(DESKTOP_MARKER)

    # the screen: the X session at its own resolution (the VGA text console is 720x400 in 16 colours),
    # mostly the window manager's background, with a task bar and the first terminal (white) on it
    shot = screenshot(store, "desk")
    assert (shot.width, shot.height) >= (1024, 768)
    colours = shot.colours()
    assert len(colours) > 50
    top, top_count = colours.most_common(1)[0]
    assert top == bytes.fromhex(BACKGROUND.lstrip("#"))
    assert 0.3 < top_count / (shot.width * shot.height) < 0.98
    def terminal_on_screen() -> bool:
        return screenshot(store, "desk").colours()[b"\xff\xff\xff"] > 50_000  # xterm's white, ~100k pixels

    wait_until(terminal_on_screen, 30, "the first terminal's window on screen", interval=1.0)

    # the session is the autologin user's, rootless X under logind; the serial console is root's shell
    assert run(store, "desk", "ps -o user= -C Xorg").split() == [USER]
    users_programs = run(store, "desk", f"for p in $(pgrep -u {USER}); do readlink /proc/$p/exe; done").split()
    assert {"/usr/lib/xorg/Xorg", "/usr/bin/jwm", "/usr/bin/xterm"} <= set(users_programs)
    assert run(store, "desk", f"loginctl --no-pager show-user {USER} -p State --value") == "active"
    assert run(store, "desk", "id -un") == "root"

    # the guest agent answers as on the Debian guest
    ping = wait_for_agent(store.instance_dir("desk") / "agent.sock", timeout=60)
    assert ping["kernel"] == info["kernel_release"] and ping["version"] == info["agent_version"]

    # suspended and restored (as a move does), the session is on screen again, the same one
    xorg_pid = run(store, "desk", "pgrep -x Xorg")
    lifecycle.suspend(store, "desk")
    assert lifecycle.start(store, "desk").mode == "restore"
    wait_until(terminal_on_screen, 30, "the terminal's window on screen after the restore", interval=1.0)
    assert screenshot(store, "desk").colours().most_common(1)[0][0] == bytes.fromhex(BACKGROUND.lstrip("#"))
    assert run(store, "desk", "pgrep -x Xorg") == xorg_pid
