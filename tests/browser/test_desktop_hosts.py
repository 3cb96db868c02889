"""The desktop image moved live between the compose hosts (two libvirts, so the moves are live) from the page, as
its owner lives with it. At work (host A) the clipboard box reaches the guest and a line is typed into its
terminal; the Migrate button sends it home (host B) live; the console follows it there, the pointer lands where
the browser's is, and the terminal takes a second line; the clipboard box pastes a third, and what the guest
copies comes back to the browser. The next morning, A's page brings it back from B with Bring here, live; the
console opens on it at A and takes a fourth line. Each time the lines are read back in the guest, through its
guest agent, on the host it runs on then, and a screenshot of the page is kept. The guest's resolution follows
the console panel's size all along, through the guest agent of the host it runs on."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from testkit.desktop import AT, CANVAS, CONSOLE_IN_VIEW, TEE, TYPED
from tests.browser.test_dashboard import _shot, browser  # noqa: F401 - fixture
from tests.browser.test_desktop_console import AIM, NEAR
from tests.helpers.composehosts import known_as
from tests.helpers.dashboard import open_console, sign_in
from tests.wait import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(1500)]

LINES = ["typed-at-work-before-the-move", "typed-at-home-after-the-move", "pasted-at-home-from-the-browser",
         "typed-at-work-after-bring-here"]

# each live move's progress (phase, state) in order, and the capsule the console hook opened on
RECORDER = """() => {
  window.__phases = [];
  new MutationObserver(() => {
    for (const li of document.querySelectorAll("#migrate-dialog ol.phases li")) {
      const seen = [li.dataset.phase, li.dataset.state];
      const last = window.__phases.filter((p) => p[0] === seen[0]).pop();
      if (!last || last[1] !== seen[1]) window.__phases.push(seen);
    }
  }).observe(document.body, { subtree: true, childList: true, attributes: true });
}"""


@pytest.fixture(scope="module")
def desk(hosts, desktop_images, tmp_path_factory) -> Iterator[tuple]:
    """The desktop image's capsule (1 GiB) pushed to host A from a store here and started there; A and B know
    each other."""
    from capsule import capsules, transfer
    from testkit.images import make_store

    a, b = hosts
    name = f"desk{uuid.uuid4().hex[:6]}"
    local = make_store(tmp_path_factory.mktemp("desk") / "store", desktop_images, "desktop")
    try:
        capsules.create(local, name, "desktop", memory="1G")
        transfer.push(local, name, a.url, a.token)
    finally:
        local.close()
    a.capsule("start", name, "--timeout", "600", timeout=900)
    home, work = known_as(a, "home", b), known_as(b, "work", a)
    yield a, b, name, home, work
    for host in (a, b):
        if host.state(name) == "running":
            host.capsule("stop", name, "--force")


def _console_fits(page) -> None:
    """The page has set the guest's resolution to its panel's (through the guest agent) and the canvas shows it:
    keys typed during that mode switch may be lost."""
    from playwright.sync_api import expect

    expect(page.locator("#console")).to_have_attribute("data-fit", "guest", timeout=60_000)
    panel = page.evaluate(CANVAS)
    page.wait_for_function(f"() => {{ const c = document.querySelector('#console-screen canvas');"
                           f" return c && c.width > {panel['cw'] - 16} && c.width <= {panel['cw']}; }}",
                           timeout=60_000)


def _into_terminal(page, host, name: str) -> None:
    """A click on the guest's terminal, found on its screen there: the terminal has the guest's keyboard focus,
    and the console the browser's."""
    left, top = wait_until(lambda: host.desktop("terminal_top_left", name), 60, "the terminal on the screen",
                           interval=1)
    page.evaluate(CONSOLE_IN_VIEW)
    page.mouse.click(*page.evaluate(AT, [left + 80, top + 40]))
    page.wait_for_timeout(500)


def _pointer_lands(page, host, name: str) -> None:
    """The browser's pointer at three points of the (relayed) console's canvas: the guest's X server, asked
    through the guest agent where the guest runs, has its pointer within NEAR pixels of the same guest pixel."""
    page.evaluate(CONSOLE_IN_VIEW)
    for fx, fy in ((0.1, 0.1), (0.5, 0.5), (0.9, 0.8)):
        aim = page.evaluate(AIM, [fx, fy])
        page.mouse.move(aim["x"] + (4 if fx < 0.5 else -4), aim["y"] + (4 if fy < 0.5 else -4))
        page.mouse.move(aim["x"], aim["y"], steps=2)
        want = (aim["gx"], aim["gy"])
        wait_until(lambda want=want: max(abs(g - w) for g, w in zip(host.desktop("pointer_at", name), want,
                                                                      strict=True)) <= NEAR,
                   20, lambda aim=aim: f"the guest's pointer near {aim}: at {host.desktop('pointer_at', name)}",
                   interval=0.5)


def _lines(host, name: str) -> list[str]:
    return host.desktop("typed_lines", name)


def _type_line(page, host, name: str, line: str, want: list[str]) -> None:
    page.keyboard.type(line, delay=20)
    page.keyboard.press("Enter")
    wait_until(lambda: _lines(host, name) == want, 60, lambda: f"{want} in {TYPED}: {_lines(host, name)}",
               interval=1)


def _done(page, says: str) -> str:
    """Wait for the move's panel to say it is done and close it; what it said of the switchover's pause."""
    from playwright.sync_api import expect

    dialog = page.locator("#migrate-dialog")
    message = dialog.locator(".migrate-message")
    expect(message).to_have_attribute("data-outcome", "done", timeout=600_000)
    expect(message).to_contain_text(says)
    detail = dialog.locator('li[data-phase="switchover"] [data-field="phase-detail"]')
    expect(detail).to_contain_text("paused")
    seen = page.evaluate("window.__phases")
    assert ["memory", "current"] in seen and ["switchover", "current"] in seen, seen     # it moved live
    text = detail.inner_text()
    dialog.locator('[data-action="close-migration"]').click()
    return text


def test_the_desktop_moves_live_home_and_is_brought_back(desk, browser, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    a, b, name, home, work = desk
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    sign_in(page, a.url, a.token)
    expect(page.locator(f'section[data-host="{home}"]')).to_have_attribute("data-reachable", "yes",
                                                                           timeout=30_000)
    row = open_console(page, name, timeout_ms=60_000)
    _console_fits(page)

    # at work: the clipboard box reaches the guest here, and a line goes into the terminal
    page.fill("#console-clip-text", "copied in the browser at work")
    page.click("#console-clip-send")
    expect(page.locator("#console-clip-state")).to_have_attribute("data-state", "sent", timeout=30_000)
    assert a.api("GET", f"/api/capsules/{name}/clipboard")["text"] == "copied in the browser at work"
    _into_terminal(page, a, name)
    page.keyboard.type(TEE, delay=20)
    page.keyboard.press("Enter")
    _type_line(page, a, name, LINES[0], LINES[:1])

    # Migrate, live, to home
    page.evaluate(RECORDER)
    row.locator('button[data-action="migrate"]').click()
    dialog = page.locator("#migrate-dialog")
    page.select_option("#migrate-to", home)
    live = dialog.locator('input[name="kind"][value="live"]')
    expect(live).to_be_enabled(timeout=30_000)
    expect(live).to_be_checked()
    started = time.monotonic()
    dialog.locator('[data-action="start-migration"]').click()
    paused = _done(page, f"now runs on {home}")
    print(f"\nmoved home live in {time.monotonic() - started:.1f} s (as the page saw it): {paused}")

    # the console followed it home, nothing clicked: type into the terminal there
    state = page.locator("#console-state")
    expect(state).to_have_attribute("data-state", "connected", timeout=30_000)
    expect(page.locator("#console")).to_have_attribute("data-peer", home)
    assert b.state(name) == "running" and a.state(name) != "running"
    # the followed console's screen follows the panel there too (set by home, through this host's agent)
    page.set_viewport_size({"width": 1440, "height": 900})
    _console_fits(page)
    _pointer_lands(page, b, name)
    _into_terminal(page, b, name)
    _type_line(page, b, name, LINES[1], LINES[:2])

    # the clipboard box of the console that followed it reaches the guest at home, both ways
    box = page.locator("#console-clip-state")
    page.fill("#console-clip-text", LINES[2])
    page.click("#console-clip-send")
    expect(box).to_have_attribute("data-state", "sent", timeout=30_000)
    assert b.api("GET", f"/api/capsules/{name}/clipboard")["text"] == LINES[2]
    _into_terminal(page, b, name)
    # Shift held on its own first: on a loaded machine an empty line was once typed here, most likely Insert
    # arriving without Shift
    page.keyboard.down("Shift")
    page.wait_for_timeout(200)
    page.keyboard.press("Insert")
    page.wait_for_timeout(200)
    page.keyboard.up("Shift")
    page.keyboard.press("Enter")
    wait_until(lambda: _lines(b, name) == LINES[:3], 60, lambda: f"{LINES[:3]} in {TYPED}: {_lines(b, name)}",
               interval=1)
    b.api("PUT", f"/api/capsules/{name}/clipboard", {"text": "copied in the desktop at home"})
    page.click("#console-clip-get")
    expect(box).to_have_attribute("data-state", "received", timeout=30_000)
    expect(page.locator("#console-clip-text")).to_have_value("copied in the desktop at home")
    _shot(page, tmp_path, "desktop-at-home")

    # the next morning at work: A's page brings it back from home, live
    page.reload()
    page.evaluate(RECORDER)
    there = page.locator(f'section[data-host="{home}"] tr[data-capsule="{name}"]')
    expect(there.locator(".badge")).to_have_attribute("data-state", "running", timeout=60_000)
    bring = there.locator('button[data-action="bring"]')
    expect(bring).to_be_enabled(timeout=30_000)
    bring.click()
    form = page.locator("#bring-dialog")
    live = form.locator('input[name="kind"][value="live"]')
    expect(live).to_be_enabled(timeout=30_000)
    expect(live).to_be_checked()
    started = time.monotonic()
    form.locator('[data-action="start-bring"]').click()
    expect(page.locator("#migrate-dialog .migrate-progress h3")).to_have_text(f"Bringing {name} here from {home}")
    paused = _done(page, f"now runs here (it came from {home})")
    print(f"brought back live in {time.monotonic() - started:.1f} s: {paused}")

    # the console opened on it here
    expect(state).to_have_attribute("data-state", "connected", timeout=60_000)
    expect(page.locator("#console")).not_to_have_attribute("data-peer", home)
    assert a.state(name) == "running" and b.state(name) != "running"
    _console_fits(page)
    _into_terminal(page, a, name)
    _type_line(page, a, name, LINES[3], LINES)
    _shot(page, tmp_path, "desktop-brought-back")
