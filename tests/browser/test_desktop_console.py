"""The desktop image's console in a real browser: the clipboard box sends a text to the guest's clipboard and
gets the guest's back (read and set through the guest agent on the other side), says when a text is too large
and sends nothing then; the guest's resolution follows the console panel's size as the browser's viewport
changes (set through the guest agent: QEMU's standard VGA refuses a client's SetDesktopSize), the canvas showing
all of it within the panel; and the pointer lands where the browser's is, on a screen shown 1:1 and on one scaled
to fit, as the guest's X server says (read through the guest agent). The tests share one desktop guest. The
desktop moved from the page between two hosts is test_desktop_hosts.py's (the compose hosts: the moves are live)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from capsule import capsules, lifecycle
from capsule.console import clipboard, pointer, screensize
from capsule.console.screen import screenshot
from capsule.store import Store
from testkit.desktop import CANVAS
from testkit.images import destroy_domains, make_store
from tests.browser.test_dashboard import _shot, browser  # noqa: F401  (the fixture)
from tests.conftest import Agent
from tests.helpers.dashboard import open_console, sign_in
from tests.wait import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

# the console card's elements that stick out of it on the right
OVERFLOW = """() => {
  const card = document.querySelector('#console').getBoundingClientRect();
  return [...document.querySelectorAll('#console *')].filter((e) => e.getBoundingClientRect().right > card.right + 1)
    .map((e) => `${e.tagName}#${e.id}`);
}"""


@dataclass
class Desk:
    store: Store
    agent: Agent


@pytest.fixture(scope="module")
def desk(desktop_images, tmp_path_factory) -> Iterator[Desk]:
    """A store with the desktop image, the capsule "desk" running in it (1 GiB) and its agent: booted once for
    the module's tests."""
    root = tmp_path_factory.mktemp("desk")
    store = make_store(root / "store", desktop_images, "desktop")
    agent = None
    try:
        capsules.create(store, "desk", "desktop", memory="1G")
        lifecycle.start(store, "desk", timeout=600)
        agent = Agent(store.home, root / "t.token")
        yield Desk(store, agent)
    finally:
        if agent is not None:
            agent.stop()
        destroy_domains(store)
        store.close()


def test_clipboard_box_and_scale_to_fit_on_the_desktop(desk, browser, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    store, agent = desk.store, desk.agent
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

    # the guest's resolution follows the panel (its width a multiple of 16), and the canvas shows it all
    expect(page.locator("#console")).to_have_attribute("data-fit", "guest", timeout=30_000)
    for viewport in ({"width": 1600, "height": 1000}, {"width": 1024, "height": 768}):
        page.set_viewport_size(viewport)
        panel = page.evaluate(CANVAS)
        want = (min(panel["cw"], 2560) // 16 * 16, max(400, min(panel["ch"], 1600)))

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


# a point of the canvas given as fractions of its CSS box: where that is on the page (whole CSS pixels, inside the
# box), and the guest's pixel there, from the canvas's framebuffer size over its CSS box (noVNC scales the guest's
# screen to fit the panel)
AIM = """([fx, fy]) => {
  const c = document.querySelector('#console-screen canvas');
  const r = c.getBoundingClientRect();
  const at = (lo, size, f) => Math.min(Math.max(Math.round(lo + f * (size - 1)), Math.ceil(lo)),
                                      Math.floor(lo + size) - 1);
  const x = at(r.left, r.width, fx), y = at(r.top, r.height, fy);
  return {x, y, gx: Math.min(c.width - 1, Math.floor((x - r.left) * c.width / r.width)),
          gy: Math.min(c.height - 1, Math.floor((y - r.top) * c.height / r.height)), fbw: c.width, fbh: c.height,
          scale: r.width / c.width};
}"""
# the corners, the middle and two points between
POINTS = [(0, 0), (1, 0), (0, 1), (1, 1), (0.5, 0.5), (0.25, 0.8), (0.9, 0.3)]
NEAR = 2      # guest pixels the pointer may be off by


def _canvas_at(page, width: int, height: int) -> None:
    page.wait_for_function(f"() => {{ const c = document.querySelector('#console-screen canvas');"
                           f" return c && c.width === {width} && c.height === {height}; }}", timeout=30_000)


def _points_land(page, store: Store) -> list[tuple[dict, tuple[int, int]]]:
    """Point at each of POINTS in the browser; each time the guest's pointer (read through the guest agent) is
    within NEAR pixels of the guest pixel under the browser's. What was aimed at and where it landed."""
    landed = []
    for fx, fy in POINTS:
        aim = page.evaluate(AIM, [fx, fy])
        # from a few pixels towards the middle, as a hand moves: the guest's kernel passes on an absolute position
        # only when it changed, and the tablet's first one is 0,0
        page.mouse.move(aim["x"] + (4 if fx < 0.5 else -4), aim["y"] + (4 if fy < 0.5 else -4))
        page.mouse.move(aim["x"], aim["y"], steps=2)
        want = (aim["gx"], aim["gy"])

        def near(want=want) -> tuple[int, int] | None:
            got = pointer.position(store, "desk")
            return got if max(abs(got[0] - want[0]), abs(got[1] - want[1])) <= NEAR else None

        got = wait_until(near, 10, lambda aim=aim: f"the guest's pointer near {aim}: it is at "
                         f"{pointer.position(store, 'desk')}", interval=0.2)
        landed.append((aim, got))
    return landed


def test_the_pointer_lands_where_the_browsers_is(desk, browser, tmp_path):  # noqa: F811
    """On the screen shown 1:1 (its resolution follows the panel), scaled down (a screen larger than the panel)
    and scaled up (a smaller one): wherever the browser's pointer is on the canvas, corners included, the guest's
    X server has its pointer on the same pixel, within 2."""
    from playwright.sync_api import expect

    store, agent = desk.store, desk.agent
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    sign_in(page, agent.url, agent.token)
    open_console(page, "desk")
    expect(page.locator("#console")).to_have_attribute("data-fit", "guest", timeout=30_000)
    panel = page.evaluate(CANVAS)
    # the guest's screen as wide as the panel, give or take the columns the width is rounded to
    page.wait_for_function(f"() => {{ const c = document.querySelector('#console-screen canvas');"
                           f" return c && c.width > {panel['cw'] - 16} && c.width <= {panel['cw']}"
                           f" && c.height === {max(400, min(panel['ch'], 1600))}; }}", timeout=30_000)
    one = _points_land(page, store)
    assert all(abs(aim["scale"] - 1) < 0.01 for aim, _ in one), one
    # the guest's screen made larger and smaller than the panel (as another console, or the guest itself, may):
    # the page scales it to fit and the pointer still lands where it points
    for size, scaled in (((1600, 1000), lambda s: s < 0.8), ((640, 400), lambda s: s > 1.2)):
        assert screensize.set_size(store, "desk", *size) == size
        _canvas_at(page, *size)
        landed = _points_land(page, store)
        assert all(scaled(aim["scale"]) for aim, _ in landed), landed
        _shot(page, tmp_path, f"desktop-pointer-{size[0]}x{size[1]}")
    print(f"\n1:1 {one}\nscaled {landed}")
