"""The desktop image's console in a real browser: the clipboard box sends a text to the guest's clipboard and
gets the guest's back (read and set through the guest agent on the other side), says when a text is too large
and sends nothing then; and the guest's resolution follows the console panel's size as the browser's viewport
changes (set through the guest agent: QEMU's standard VGA refuses a client's SetDesktopSize), the canvas showing
all of it within the panel."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from capsule.console import clipboard
from capsule.console.screen import screenshot
from tests.browser.test_dashboard import _shot, browser  # noqa: F401  (the fixture)
from tests.conftest import Agent
from tests.helpers.dashboard import open_console, sign_in
from tests.wait import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

# the screen's canvas as the page shows it (CSS pixels) and the panel it sits in
CANVAS = """() => {
  const c = document.querySelector('#console-screen canvas');
  const p = document.querySelector('#console-screen').getBoundingClientRect();
  if (!c || !c.width) return null;
  const r = c.getBoundingClientRect();
  const e = document.querySelector('#console-screen');
  return {fbw: c.width, fbh: c.height, w: r.width, h: r.height, pw: p.width, ph: p.height, cw: e.clientWidth,
          ch: e.clientHeight};
}"""


# the console card's elements that stick out of it on the right
OVERFLOW = """() => {
  const card = document.querySelector('#console').getBoundingClientRect();
  return [...document.querySelectorAll('#console *')].filter((e) => e.getBoundingClientRect().right > card.right + 1)
    .map((e) => `${e.tagName}#${e.id}`);
}"""


def test_clipboard_box_and_scale_to_fit_on_the_desktop(desktop_store, browser, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    store = desktop_store
    capsules.create(store, "desk", "desktop", memory="1G")
    lifecycle.start(store, "desk", timeout=600)
    agent = Agent(store.home, tmp_path / "t.token")
    try:
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        sign_in(page, agent.url, agent.token)
        open_console(page, "desk")
        expect(page.locator("#console-clip")).to_be_visible()
        expect(page.locator("#console-fullscreen")).to_be_visible()

        # browser → guest
        text = "aus dem Browser: Grüße, ß 🙂"
        page.fill("#console-clip-text", text)
        page.click("#console-clip-send")
        state = page.locator("#console-clip-state")
        expect(state).to_have_attribute("data-state", "sent", timeout=30_000)
        expect(state).to_contain_text(f"sent {len(text.encode())} B")
        assert clipboard.get(store, "desk") == text

        # guest → browser
        clipboard.set(store, "desk", "from the guest\nsecond line")
        page.click("#console-clip-get")
        expect(state).to_have_attribute("data-state", "received", timeout=30_000)
        expect(page.locator("#console-clip-text")).to_have_value("from the guest\nsecond line")

        # too large: said at once, nothing sent
        page.fill("#console-clip-text", "x" * (clipboard.MAX_BYTES + 1))
        page.click("#console-clip-send")
        expect(state).to_have_attribute("data-state", "too-large")
        expect(state).to_contain_text("512 KiB")
        assert clipboard.get(store, "desk") == "from the guest\nsecond line"
        _shot(page, tmp_path, "desktop-clipboard")
        assert page.evaluate(OVERFLOW) == []

        # the guest's resolution follows the panel (width in whole 8-pixel columns), and the canvas shows it all
        expect(page.locator("#console")).to_have_attribute("data-fit", "guest", timeout=30_000)
        for viewport in ({"width": 1600, "height": 1000}, {"width": 1024, "height": 768}):
            page.set_viewport_size(viewport)
            panel = page.evaluate(CANVAS)
            want = (min(panel["cw"], 2560) // 8 * 8, max(400, min(panel["ch"], 1600)))

            def guest_size() -> tuple[int, int]:
                shot = screenshot(store, "desk")
                return shot.width, shot.height

            wait_until(lambda want=want: guest_size() == want, 30,
                       lambda want=want: f"the guest's screen at {want}: {guest_size()}", interval=0.5)
            page.wait_for_function(f"() => {{ const c = document.querySelector('#console-screen canvas');"
                                   f" return c && c.width === {want[0]} && c.height === {want[1]}; }}")
            shown = page.evaluate(CANVAS)
            assert shown["w"] <= shown["pw"] + 1 and shown["h"] <= shown["ph"] + 1, shown
            assert shown["w"] >= want[0] - 2 or shown["h"] >= want[1] - 2, shown     # shown at (about) 1:1
        # the console card's controls stay inside it (the clipboard box wraps)
        assert page.evaluate(OVERFLOW) == []
        _shot(page, tmp_path, "desktop-1024")
    finally:
        agent.stop()
