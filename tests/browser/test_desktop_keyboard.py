"""A non-US keyboard through the desktop image's console: the page's keyboard in a German layout (the browser's
key events carry the German key and the physical key's code, as a German keyboard gives them), the guest's X
session in the German layout too (``setxkbmap de``). The keys labelled Z, Y and ß (physical KeyY, KeyZ and Minus)
must reach the guest as 'z', 'y' and 'ß': the console sends the physical keys' scancodes (QEMU's extended key
events) and the guest's own layout maps them. A console that sent keysyms only would have QEMU map them through
its US table: 'z' would land on the US z key (a 'y' on the German guest) and 'ß' on no key at all."""

from __future__ import annotations

import base64
import time

import pytest

from capsule import capsules, lifecycle
from capsule.console import guestx
from tests.browser.test_dashboard import _shot, browser  # noqa: F401  (the fixture)
from tests.conftest import Agent
from tests.helpers.dashboard import open_console, sign_in
from tests.wait import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

TYPED = "/tmp/capsule-typed"
# as the session's user, with its X cookie: the German layout, then a maximised terminal whose input lands in TYPED
SESSION = ("export DISPLAY=:0 XAUTHORITY=$HOME/.Xauthority LANG=C.UTF-8; setxkbmap de || exit 3;"
           f" setsid xterm -u8 -maximized -e sh -c 'stty -echo; cat > {TYPED}' </dev/null >/dev/null 2>&1 &")

# (key, code, Windows virtual key code, held) as a German keyboard gives them to the browser: the keys labelled
# Z, Y and ß; Shift with the key labelled Y; AltGr with Q (an '@' on a German keyboard); Enter
SHIFT = ("Shift", "ShiftLeft", 0x10)
ALTGR = ("AltGraph", "AltRight", 0xA5)
GERMAN = [("z", "KeyY", 0x5A, None), ("y", "KeyZ", 0x59, None), ("ß", "Minus", 0xDB, None),
          ("Y", "KeyZ", 0x59, SHIFT), ("@", "KeyQ", 0x51, ALTGR), ("Enter", "Enter", 0x0D, None)]
WANT = "zyßY@\n"


def _guest(store, argv: list[str]) -> dict:
    with guestx.agent(store, "desk", "keyboard test") as ga:
        return guestx.run(ga, "desk", "keyboard test", argv)


def _typed(store) -> str | None:
    r = _guest(store, ["sh", "-c", f"test -e {TYPED} && base64 {TYPED}"])
    return base64.b64decode(r["stdout"]).decode("utf-8", "replace") if r["exit_code"] == 0 else None


def _key(cdp, kind: str, key: str, code: str, vk: int, modifiers: int = 0) -> None:
    event = {"type": kind, "key": key, "code": code, "windowsVirtualKeyCode": vk, "modifiers": modifiers}
    if kind == "keyDown" and (len(key) == 1 or key == "Enter"):
        event["text"] = event["unmodifiedText"] = "\r" if key == "Enter" else key
    cdp.send("Input.dispatchKeyEvent", event)


def _press(cdp, key: str, code: str, vk: int, held: tuple[str, str, int] | None) -> None:
    """One key as the browser gets it from the German keyboard, with Shift or AltGr held around it."""
    modifiers = 8 if held == SHIFT else 0
    if held:
        _key(cdp, "rawKeyDown", *held, modifiers=modifiers)
    _key(cdp, "keyDown", key, code, vk, modifiers)
    _key(cdp, "keyUp", key, code, vk, modifiers)
    if held:
        _key(cdp, "keyUp", *held)


# the screen's size as noVNC draws it
FRAMEBUFFER = """() => { const c = document.querySelector('#console-screen canvas');
  return c && c.width ? `${c.width}x${c.height}` : null; }"""


def _settled(page, seconds: float = 3.0, timeout: float = 120.0) -> None:
    """Wait until the console's framebuffer has kept one size for ``seconds``: the page's resize of the guest
    (through its agent, seconds under TCG) is over."""
    seen: list[tuple[float, str | None]] = []

    def still() -> bool:
        now = time.monotonic()
        seen.append((now, page.evaluate(FRAMEBUFFER)))
        size = seen[-1][1]
        since = next((t for t, s in reversed(seen) if s != size), None)
        start = seen[0][0] if since is None else since
        return size is not None and now - start >= seconds

    wait_until(still, timeout, lambda: f"the console's size never settled: {seen[-5:]}", interval=0.5)


def test_german_keys_reach_the_german_guest_as_typed(desktop_store, browser, tmp_path):  # noqa: F811

    store = desktop_store
    capsules.create(store, "desk", "desktop", memory="1G")
    lifecycle.start(store, "desk", timeout=600)
    agent = Agent(store.home, tmp_path / "t.token")
    try:
        r = _guest(store, ["runuser", "-l", "user", "-c", SESSION])
        assert r["exit_code"] == 0, r
        wait_until(lambda: _typed(store) is not None, 60, "the terminal in the guest never started",
                   interval=1)

        page = browser.new_page(viewport={"width": 1280, "height": 900})
        sign_in(page, agent.url, agent.token)
        open_console(page, "desk")
        _settled(page)      # the guest's resolution follows the panel: a mode switch while typing loses keys
        page.locator("#console-screen canvas").click()     # the console's focus; the pointer on the terminal
        page.wait_for_timeout(1000)

        cdp = page.context.new_cdp_session(page)
        for key, code, vk, held in GERMAN:
            _press(cdp, key, code, vk, held)
            page.wait_for_timeout(150)
        wait_until(lambda: (_typed(store) or "").endswith("\n"), 30,
                   lambda: f"the guest's terminal got {_typed(store)!r}", interval=1)
        _shot(page, tmp_path, "desktop-keyboard-de")
        assert _typed(store) == WANT
    finally:
        agent.stop()
