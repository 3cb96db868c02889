"""The live console in a real browser: noVNC in the page, through the agent's ticketed WebSocket, to a real
tiny guest's screen, and xterm.js on its serial console. The test writes to the guest's screen through its
serial console and checks the canvas's pixels follow; a ticket for one capsule does not open another."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from tests.browser.test_dashboard import _shot, browser  # noqa: F401  (the fixture)
from tests.helpers.guest import run
from tests.wait import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

# how many of the canvas's pixels are lit (text on the black VGA text screen), and its size
LIT = """() => {
  const c = document.querySelector('#console-screen canvas');
  if (!c || !c.width) return null;
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let lit = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i] + d[i + 1] + d[i + 2] > 200) lit++;
  return {w: c.width, h: c.height, lit};
}"""

# the page asks for a ticket for one capsule and opens another's console with it: the handshake is refused
CROSS = """async ([mine, other]) => {
  const s = await (await fetch('/api/session')).json();
  const r = await fetch(`/api/capsules/${mine}/console-ticket`, {method: 'POST', headers: {'X-CSRF-Token': s.csrf}});
  const t = await r.json();
  return await new Promise((resolve) => {
    const ws = new WebSocket(`ws://${location.host}/api/console/${other}?ticket=${t.ticket}`);
    ws.onopen = () => { ws.close(); resolve('opened'); };
    ws.onerror = () => resolve('refused');
  });
}"""

# the kernel's own messages kept off the screen (only emergencies): a guest restored after a suspend can log a
# clock or stall warning to tty0, lines the pixel counts below would take for a screen that changed
QUIET = "dmesg -n 1"
CLEAR = "printf '\\033[2J\\033[H' > /dev/tty0"
WRITE = "for i in $(seq 1 18); do echo CAPSULE-LIVE-CONSOLE-LINE-$i-XXXXXXXXXXXXXXXXXXXXXXXXXXXXXX > /dev/tty0; done"


def _lit(page) -> dict | None:
    return page.evaluate(LIT)


def test_console_shows_the_guest_screen_and_a_ticket_opens_one_capsule(two_hosts, browser, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    a, _b, agent_a, _agent_b = two_hosts
    capsules.create(a, "desk", "tiny", memory="256M")
    capsules.create(a, "other", "tiny", memory="256M")
    lifecycle.start(a, "desk")
    lifecycle.start(a, "other")

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    blocked: list[str] = []     # what the page's Content-Security-Policy refused (the consoles need none of it)
    page.on("console", lambda m: "Content Security Policy" in m.text and blocked.append(m.text))
    page.goto(agent_a.url)
    page.fill("#token", agent_a.token)
    page.click("#sign-in-form button[type=submit]")
    row = page.locator('section[data-host="local"] tr[data-capsule="desk"]')
    expect(row.locator(".badge")).to_have_attribute("data-state", "running")

    row.locator('button[data-action="console"]').click()
    expect(page.locator("#console")).to_be_visible()
    expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=30_000)

    # a cleared screen is almost uniform (the cursor only); lines of text light many pixels
    run(a, "desk", QUIET)
    run(a, "desk", CLEAR)
    cleared = wait_until(lambda: (s := _lit(page)) and s["lit"] < 200 and s, 20,
                         lambda: f"a cleared screen: {_lit(page)}")
    assert cleared["w"] >= 640 and cleared["h"] >= 350
    run(a, "desk", WRITE)
    written = wait_until(lambda: (s := _lit(page)) and s["lit"] > cleared["lit"] + 5000 and s, 20,
                         lambda: f"text on the screen: {_lit(page)}")
    _shot(page, tmp_path, "console")

    # a ticket for desk does not open other's console
    assert page.evaluate(CROSS, ["desk", "other"]) == "refused"
    assert page.evaluate(CROSS, ["desk", "desk"]) == "opened"

    # suspend and restore: the screen (its VGA state) comes back with the memory image; reconnect shows it
    lifecycle.suspend(a, "desk")
    expect(page.locator("#console-state")).to_have_attribute("data-state", "disconnected", timeout=30_000)
    assert lifecycle.start(a, "desk").mode == "restore"
    page.click("#console-reconnect")
    expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=30_000)
    wait_until(lambda: (s := _lit(page)) and abs(s["lit"] - written["lit"]) < 500, 20,
               lambda: f"the same text after the restore ({written['lit']} lit pixels): {_lit(page)}")

    # the serial console of the same capsule: the log's tail first, then typed commands run in the guest
    page.click("#console-kind-serial")
    expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=30_000)
    expect(page.locator("#console-screen")).to_be_hidden()
    page.locator("#console-serial .xterm").click()
    page.keyboard.type("echo SERIAL-$((6*7))-OK\n")
    expect(page.locator("#console-serial .xterm-rows")).to_contain_text("SERIAL-42-OK", timeout=20_000)
    _shot(page, tmp_path, "console-serial")
    assert blocked == []

    page.click("#console-close")
    expect(page.locator("#console")).to_be_hidden()


def test_page_works_without_the_npm_libraries_and_says_what_to_do(store, browser, tmp_path):  # noqa: F811
    """A host where `make web` did not run: the dashboard still works; the console says how to get it."""
    import os

    from playwright.sync_api import expect

    from tests.conftest import Agent

    capsules.create(store, "desk", "tiny", memory="256M")
    lifecycle.start(store, "desk", wait=False)
    (tmp_path / "empty").mkdir()
    agent = Agent(store.home, tmp_path / "t.token", env=os.environ | {"CAPSULE_NODE_MODULES": str(tmp_path / "empty")})
    try:
        page = browser.new_page()
        page.goto(agent.url)
        page.fill("#token", agent.token)
        page.click("#sign-in-form button[type=submit]")
        row = page.locator('section[data-host="local"] tr[data-capsule="desk"]')
        expect(row.locator(".badge")).to_have_attribute("data-state", "running")
        row.locator('button[data-action="console"]').click()
        expect(page.locator("#alert-text")).to_contain_text("make web")
        expect(page.locator("#console")).to_be_hidden()
        expect(row.locator(".badge")).to_have_attribute("data-state", "running")   # the page still refreshes
    finally:
        agent.stop()


def test_a_peers_console_through_this_host(two_hosts, browser):  # noqa: F811
    """Signed in at A only: a capsule running on peer B shows its screen, relayed by A's agent."""
    from playwright.sync_api import expect

    from capsule import hosts

    a, b, agent_a, agent_b = two_hosts
    hosts.add(a, "home", agent_b.url, agent_b.token)
    capsules.create(b, "far", "tiny", memory="256M")
    lifecycle.start(b, "far")
    run(b, "far", CLEAR + "; " + WRITE)

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(agent_a.url)
    page.fill("#token", agent_a.token)
    page.click("#sign-in-form button[type=submit]")
    row = page.locator('section[data-host="home"] tr[data-capsule="far"]')
    expect(row.locator(".badge")).to_have_attribute("data-state", "running", timeout=20_000)
    row.locator('button[data-action="console"]').click()
    expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=30_000)
    expect(page.locator("#console-title")).to_have_text("far on home")
    wait_until(lambda: (s := _lit(page)) and s["lit"] > 5000, 20, lambda: f"B's screen with text: {_lit(page)}")
    # and by the peer's URL, as the migrate dialog knows it
    page.evaluate("""async (url) => (await import('/web/js/console.js')).openConsole(url, 'far')""", agent_b.url)
    expect(page.locator("#console")).to_have_attribute("data-host", agent_b.url)
    expect(page.locator("#console")).to_have_attribute("data-peer", "home")
    expect(page.locator("#console-title")).to_have_text("far on home")
    expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=30_000)
    wait_until(lambda: (s := _lit(page)) and s["lit"] > 5000, 20, lambda: f"B's screen again: {_lit(page)}")
