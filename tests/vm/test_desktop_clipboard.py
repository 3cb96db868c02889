"""The desktop image's pointer and clipboard, in a real guest: the screen's virtio tablet is an input device of the
X session, and a VNC client's pointer lands where it points (within 2 px, read back through the guest's X
server); a text made the guest's clipboard through the guest agent is what the X server hands out and what comes
back, also once the guest has been suspended and restored (as a move does); a middle click pastes it in the
terminal, and a line selected in the terminal (a triple click through VNC) is what the clipboard then reads. The
screen's resolution follows what the console asks for (a listed mode, and one made for the size), the VNC server
tells its client, and the pointer still lands where it points; a mode the card refuses leaves the screen as it
was."""

from __future__ import annotations

import struct
import time

import pytest

from capsule import capsules, lifecycle
from capsule.console import clipboard, guestx, screensize
from capsule.console.screen import connect_screen, screenshot
from capsule.imagebuild.desktop import BACKGROUND, USER
from capsule.runtime.guestagent import GuestAgent, exec_result, wait_for_agent
from capsule.store import Store
from testkit.desktop import terminal_top_left
from tests.helpers.guest import run
from tests.wait import wait_until

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(900)]


class Vnc:
    """A VNC client of the capsule's screen that only points, clicks and types (RFB 3.8, no security, shared)."""

    def __init__(self, store: Store, name: str) -> None:
        self.sock = connect_screen(store, name)
        self.sock.settimeout(10)
        assert self._recv(12).startswith(b"RFB 003.")
        self.sock.sendall(b"RFB 003.008\n")
        assert 1 in self._recv(self._recv(1)[0])
        self.sock.sendall(b"\x01")
        assert self._recv(4) == b"\0\0\0\0"
        self.sock.sendall(b"\x01")
        self.width, self.height = struct.unpack(">HH", self._recv(4))
        self._recv(16)
        self._recv(struct.unpack(">I", self._recv(4))[0])
        self.sock.sendall(struct.pack(">BxHi", 2, 1, 0))      # SetEncodings: raw

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, "the VNC server closed the connection"
            buf += chunk
        return buf

    def point(self, x: int, y: int, buttons: int = 0) -> None:
        self.sock.sendall(struct.pack(">BBHH", 5, buttons, x, y))

    def click(self, x: int, y: int, button: int = 1, times: int = 1) -> None:
        for _ in range(times):         # apart: libinput drops a button's changes within ~25 ms as bounces
            self.point(x, y, button)
            time.sleep(0.05)
            self.point(x, y, 0)
            time.sleep(0.05)
        time.sleep(0.5)

    def key(self, keysym: int) -> None:
        self.sock.sendall(struct.pack(">BBxxI", 4, 1, keysym) + struct.pack(">BBxxI", 4, 0, keysym))

    def close(self) -> None:
        self.sock.close()


def guest_pointer(store: Store, name: str) -> tuple[int, int]:
    with GuestAgent(store.instance_dir(name) / "agent.sock", timeout=10) as agent:
        r = exec_result(agent.call("exec", {"argv": ["python3", "-", "pointer"], "stdin": guestx.HELPER},
                                    timeout=20))
    assert r["exit_code"] == 0, r["stderr"]
    x, y = r["stdout"].split()
    return int(x), int(y)


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

    # the pointer: where a VNC client (the page's noVNC) points is where the guest's pointer is
    vnc = Vnc(store, "desk")
    try:
        for x, y in ((300, 200), (777, 555), (vnc.width - 3, vnc.height - 3)):
            vnc.point(x, y)
            got = wait_until(lambda x=x, y=y: (p := guest_pointer(store, "desk")) and
                             abs(p[0] - x) <= 2 and abs(p[1] - y) <= 2 and p, 10,
                             lambda x=x, y=y: f"the guest's pointer at {x},{y}: {guest_pointer(store, 'desk')}")
            assert got

        # paste in the terminal: what was set is its primary selection too; a middle click pastes it
        left, top = wait_until(lambda: terminal_top_left(store, "desk"), 20, "the terminal on the screen",
                               interval=1.0)
        clipboard.set(store, "desk", "echo PASTED-$((6*7)) > /tmp/pasted")
        vnc.click(left + 200, top + 100, button=2)
        vnc.key(0xFF0D)                                             # Return
        wait_until(lambda: run(store, "desk", "cat /tmp/pasted 2>/dev/null") == "PASTED-42",
                   20, "the pasted command's output", interval=0.5)

        # copy in the guest: a line selected in the terminal (a triple click) is what the clipboard reads now
        run(store, "desk", f"for t in $(ps -o tty= -u {USER} -C bash); do printf '\\033[2J\\033[HSELECT-ME-42\\n'"
                           " > /dev/$t; done")
        time.sleep(1.0)
        vnc.click(left + 30, top + 8, times=3)
        wait_until(lambda: clipboard.get(store, "desk").strip() == "SELECT-ME-42", 10,
                   lambda: f"the selected line on the clipboard: {clipboard.get(store, 'desk')!r}", interval=0.5)
    finally:
        vnc.close()

    # the screen's size, set through the agent: the X server's mode, the screen QEMU shows and VNC reports
    for want, got in (((1024, 768), (1024, 768)), ((1500, 900), (1488, 900)), ((4000, 100), (2560, 400))):
        assert screensize.set_size(store, "desk", *want) == got
        shot = wait_until(lambda got=got: (s := screenshot(store, "desk")) and (s.width, s.height) == got and s, 10,
                          lambda got=got: f"the screen at {got}: {screenshot(store, 'desk').width}")
        assert shot.colours().most_common(1)[0][0] == bytes.fromhex(BACKGROUND.lstrip("#"))
    # a mode the guest's card refuses (two frames of it do not fit its 16 MiB; set_size never asks for one): the
    # helper says so, and the screen keeps its size and stays lit, so the next size is set as ever
    with guestx.agent(store, "desk", "screen size") as agent:
        r = guestx.helper(agent, "desk", "screen size", "size", "2560", "1600")
    assert r["exit_code"] == guestx.NO_ANSWER and "keeps its 2560x400" in r["stderr"], r
    shot = screenshot(store, "desk")
    assert (shot.width, shot.height) == (2560, 400)
    assert shot.colours().most_common(1)[0][0] == bytes.fromhex(BACKGROUND.lstrip("#"))
    assert screensize.set_size(store, "desk", 2560, 1600) == (1824, 1144)
    assert screensize.set_size(store, "desk", 2560, 400) == (2560, 400)
    vnc = Vnc(store, "desk")
    try:
        assert (vnc.width, vnc.height) == (2560, 400)
        vnc.point(2000, 300)
        wait_until(lambda: (p := guest_pointer(store, "desk")) and abs(p[0] - 2000) <= 2 and abs(p[1] - 300) <= 2, 10,
                   lambda: f"the pointer at 2000,300: {guest_pointer(store, 'desk')}", interval=0.5)
    finally:
        vnc.close()
