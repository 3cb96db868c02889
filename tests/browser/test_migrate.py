"""The Migrate button in a real browser (Debian's chromium driven by Playwright), between two hosts on this
machine with a real guest: the phases advance, the capsule ends up running on the other host (shown in its
list, its counter going on), the console hook is called for the destination; the real console panel follows
the capsule there by itself and shows the same screen; and a cancel from the page leaves it running here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from capsule import capsules, hosts, lifecycle
from capsule.runtime.connection import lookup_domain
from tests.browser.test_dashboard import SCREENSHOTS, browser  # noqa: F401 - fixture
from tests.helpers.guest import COUNTER, count, run, wait_count_above
from tests.wait import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(400)]

DOCS = Path(__file__).resolve().parents[2] / "docs"

# every (phase, state) the dialog shows, in order, and what the console hook was called with
RECORDER = """() => {
  window.__phases = [];
  window.capsuleConsole = { openConsole: (url, name) => { window.__followed = [url, name]; } };
  new MutationObserver(() => {
    for (const li of document.querySelectorAll("#migrate-dialog ol.phases li")) {
      const seen = [li.dataset.phase, li.dataset.state];
      const last = window.__phases.filter((p) => p[0] === seen[0]).pop();
      if (!last || last[1] !== seen[1]) window.__phases.push(seen);
    }
  }).observe(document.body, { subtree: true, childList: true, attributes: true });
}"""


def _signed_in(browser, agent):  # noqa: F811
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    page.goto(agent.url)
    page.fill("#token", agent.token)
    page.click("#sign-in-form button[type=submit]")
    return page


def _running(store, name: str) -> int:
    capsules.create(store, name, "tiny", memory="256M")
    lifecycle.start(store, name)
    run(store, name, COUNTER)
    return wait_count_above(store, name, 5)


def test_migrate_with_the_button(two_hosts, browser, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    a, b, agent_a, agent_b = two_hosts
    before = _running(a, "desk")
    hosts.add(a, "home", agent_b.url, agent_b.token)
    page = _signed_in(browser, agent_a)
    row = page.locator('section[data-host="local"] tr[data-capsule="desk"]')
    expect(row.locator(".badge")).to_have_attribute("data-state", "running")
    expect(page.locator('section[data-host="home"]')).to_have_attribute("data-reachable", "yes")
    page.evaluate(RECORDER)

    row.locator('button[data-action="migrate"]').click()
    dialog = page.locator("#migrate-dialog")
    expect(dialog).to_be_visible()
    page.select_option("#migrate-to", "home")
    # both hosts are this machine's one libvirtd: the pre-check greys Live out, with its reason
    live = dialog.locator('input[name="kind"][value="live"]')
    expect(live).to_be_disabled(timeout=30_000)
    expect(dialog.locator('[data-kind="live"]')).to_have_attribute("data-refused", "same_host")
    expect(dialog.locator('[data-field="live-refused"]')).to_contain_text(
        "the destination is this machine's own libvirt: a live move needs another host")
    dialog.locator('input[name="kind"][value="full"]').check()
    dialog.locator('input[name="balloon"]').check()
    dialog.locator('[data-action="start-migration"]').click()

    message = dialog.locator(".migrate-message")
    expect(message).to_have_attribute("data-outcome", "done", timeout=240_000)
    expect(message).to_contain_text("now runs on home")
    phases = dialog.locator("ol.phases li")
    expect(phases).to_have_count(5)
    for li in phases.all():
        expect(li).to_have_attribute("data-state", "done")
    expect(dialog.locator('[data-field="wire"]')).not_to_have_text("–")
    shot = tmp_path / "migrate.png"
    dialog.screenshot(path=str(shot))
    if SCREENSHOTS:
        shutil.copyfile(shot, Path(SCREENSHOTS) / "migrate.png")

    # every phase was shown as the current one, in order, and then as done
    seen = page.evaluate("window.__phases")
    current = [p for p, s in seen if s == "current"]
    assert current == ["balloon", "save", "memory", "disk", "resume"], seen
    # the console hook was called for the destination
    assert page.evaluate("window.__followed") == [agent_b.url, "desk"]

    dialog.locator('[data-action="close-migration"]').click()
    expect(dialog).to_be_hidden()
    there = page.locator('section[data-host="home"] tr[data-capsule="desk"] .badge')
    expect(there).to_have_attribute("data-state", "running", timeout=30_000)
    expect(row.locator(".badge")).not_to_have_attribute("data-state", "running", timeout=30_000)
    assert lookup_domain(a.domain_name("desk")) is None and lookup_domain(b.domain_name("desk")) is not None
    after = count(b, "desk")
    assert before <= after and wait_count_above(b, "desk", after) > after


def test_cancel_from_the_page_keeps_it_running_here(two_hosts, browser):  # noqa: F811
    from playwright.sync_api import expect

    a, b, agent_a, agent_b = two_hosts
    before = _running(a, "desk")
    hosts.add(a, "home", agent_b.url, agent_b.token)
    page = _signed_in(browser, agent_a)
    row = page.locator('section[data-host="local"] tr[data-capsule="desk"]')
    expect(row.locator(".badge")).to_have_attribute("data-state", "running")
    page.evaluate(RECORDER)
    row.locator('button[data-action="console"]').click()      # its console is open during the attempt
    state = page.locator("#console-state")
    expect(state).to_have_attribute("data-state", "connected", timeout=30_000)

    row.locator('button[data-action="migrate"]').click()
    dialog = page.locator("#migrate-dialog")
    expect(dialog.locator("#migrate-to")).to_have_value("home")  # the only peer, chosen
    dialog.locator('input[name="kind"][value="full"]').check()
    dialog.locator('input[name="balloon"]').check()   # ballooning takes seconds: time to cancel
    dialog.locator('[data-action="start-migration"]').click()
    cancel = dialog.locator('[data-action="cancel-migration"]')
    expect(cancel).to_be_enabled()
    cancel.click()
    message = dialog.locator(".migrate-message")
    expect(message).to_have_attribute("data-outcome", "cancelled", timeout=120_000)
    expect(message).to_contain_text("runs here again")
    assert page.evaluate("window.__followed") is None
    # the console is on the capsule here again, with no click
    expect(message).to_contain_text("The console is back on it here.")
    expect(state).to_have_attribute("data-state", "connected", timeout=30_000)
    expect(page.locator("#console")).to_have_attribute("data-peer", "")
    dialog.locator('[data-action="close-migration"]').click()
    expect(row.locator(".badge")).to_have_attribute("data-state", "running", timeout=30_000)
    assert lookup_domain(b.domain_name("desk")) is None and lookup_domain(a.domain_name("desk")) is not None
    after = count(a, "desk")
    assert before <= after and wait_count_above(a, "desk", after) > after


# the console's screen as lit pixels per band of the canvas (one band per VGA text row: 25 of them)
BANDS = """(bands) => {
  const c = document.querySelector('#console-screen canvas');
  if (!c || c.width < 640) return null;
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  const rows = new Array(bands).fill(0);
  for (let y = 0; y < c.height; y++) {
    const b = Math.min(bands - 1, Math.floor(y * bands / c.height));
    for (let x = 0; x < c.width; x++) {
      const i = (y * c.width + x) * 4;
      if (d[i] + d[i + 1] + d[i + 2] > 200) rows[b]++;
    }
  }
  return {w: c.width, h: c.height, rows};
}"""
ROWS = 25
STEPS = 12      # the mark: a staircase of 12 lines, line i holding 5*i '#'
MARK = ("printf '\\033[2J\\033[H' > /dev/tty0; "
        f"for i in $(seq 1 {STEPS}); do printf '%*s\\n' $((5*i)) '' | tr ' ' '#' > /dev/tty0; done")
CURSOR = 40     # lit pixels a blinking cursor may add to or take from one band


def _bands(page) -> dict | None:
    return page.evaluate(BANDS, ROWS)


def _staircase(s: dict | None) -> bool:
    """The mark is on the screen: the first STEPS bands grow line by line, the rest is nearly dark."""
    if not s:
        return False
    r = s["rows"]
    return (all(r[i] + 50 < r[i + 1] for i in range(STEPS - 1)) and r[0] > 50
            and all(x <= CURSOR for x in r[STEPS + 1:]))


def test_the_console_follows_the_capsule_and_shows_the_same_screen(two_hosts, browser, tmp_path):  # noqa: F811
    """The console panel is open on the capsule here; a mark is on its screen. Migrate with the button: with
    no other click the panel connects to the capsule on the destination (through this host's agent) and the
    canvas shows the same mark, and what the guest writes there next."""
    from playwright.sync_api import expect

    a, b, agent_a, agent_b = two_hosts
    before = _running(a, "desk")
    run(a, "desk", MARK)
    hosts.add(a, "home", agent_b.url, agent_b.token)
    page = _signed_in(browser, agent_a)
    row = page.locator('section[data-host="local"] tr[data-capsule="desk"]')
    expect(row.locator(".badge")).to_have_attribute("data-state", "running")
    expect(page.locator('section[data-host="home"]')).to_have_attribute("data-reachable", "yes")

    panel, state = page.locator("#console"), page.locator("#console-state")
    row.locator('button[data-action="console"]').click()
    expect(state).to_have_attribute("data-state", "connected", timeout=30_000)
    expect(panel).to_have_attribute("data-peer", "")                  # this host's own console
    here = wait_until(lambda: (s := _bands(page)) and _staircase(s) and s, 30,
                      lambda: f"the mark on the screen here: {_bands(page)}")

    row.locator('button[data-action="migrate"]').click()
    dialog = page.locator("#migrate-dialog")
    page.select_option("#migrate-to", "home")
    dialog.locator('input[name="kind"][value="full"]').check()
    dialog.locator('[data-action="start-migration"]').click()
    # the guest leaves this host: the connection here ends
    expect(state).not_to_have_attribute("data-state", "connected", timeout=120_000)
    expect(state).to_contain_text("moving to home")
    message = dialog.locator(".migrate-message")
    expect(message).to_have_attribute("data-outcome", "done", timeout=240_000)
    expect(message).to_contain_text("The console follows it there.")

    # nothing clicked since: the panel is connected to the capsule on home
    expect(state).to_have_attribute("data-state", "connected", timeout=30_000)
    expect(panel).to_have_attribute("data-capsule", "desk")
    expect(panel).to_have_attribute("data-host", agent_b.url)
    expect(panel).to_have_attribute("data-peer", "home")
    expect(page.locator("#console-title")).to_have_text("desk on home")
    assert lookup_domain(a.domain_name("desk")) is None and lookup_domain(b.domain_name("desk")) is not None

    # the same screen: the mark, band for band (a blinking cursor aside)
    there = wait_until(lambda: (s := _bands(page)) and _staircase(s) and s, 30,
                       lambda: f"the mark on the screen there: {_bands(page)} (here it was {here})")
    assert (there["w"], there["h"]) == (here["w"], here["h"])
    diff = [abs(x - y) for x, y in zip(here["rows"], there["rows"], strict=True)]
    assert max(diff) <= CURSOR, (here["rows"], there["rows"])
    dialog.screenshot(path=str(tmp_path / "followed.png"))
    page.screenshot(path=str(tmp_path / "followed-page.png"), full_page=True)

    # and it is live there: what the guest on home writes now shows on the canvas, the mark staying above it
    run(b, "desk", "echo CAPSULE-ARRIVED-AT-HOME-XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX > /dev/tty0")
    wait_until(lambda: (s := _bands(page)) and s["rows"][STEPS] > there["rows"][STEPS] + 500 and _staircase(
        {"rows": s["rows"][:STEPS + 1] + [0] * (ROWS - STEPS - 1)}), 20,
        lambda: f"the new line under the mark: {_bands(page)}")
    after = count(b, "desk")
    assert before <= after and wait_count_above(b, "desk", after) > after
