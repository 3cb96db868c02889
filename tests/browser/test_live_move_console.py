"""A live move started with the dashboard's Migrate button, between two separate hosts (the compose hosts: a live
move needs two libvirts), in a real browser: while the guest's memory travels (pre-copy) its console at the
source stays connected and takes keystrokes (the move's progress is a panel beside it, not a modal dialog over
the page): a command typed on its screen runs in the guest there and then, and what it wrote is in the guest
on the destination after the move; and at the switchover the console follows the capsule there by itself."""

from __future__ import annotations

import pytest

from tests.browser.test_dashboard import browser  # noqa: F401 - fixture
from tests.helpers.composehosts import known_as

pytestmark = [pytest.mark.browser, pytest.mark.timeout(1200)]

# a guest that keeps rewriting part of its memory: pre-copy takes rounds (and seconds) to converge
DIRTIER = ("(while :; do dd if=/dev/urandom of=/dev/shm/dirty bs=1M count=32 conv=notrunc 2>/dev/null; done) "
           "</dev/null >/dev/null 2>&1 &")
# the tiny guest's shell is on its serial line: a second one on the screen's virtual terminal (tty1), which the
# console's keystrokes reach
SCREEN_SHELL = "setsid sh -c 'exec sh -i </dev/tty1 >/dev/tty1 2>&1' </dev/null >/dev/null 2>&1 &"
# (no character that needs Shift: QEMU's keyboard gets noVNC's keysyms as keys, and a synthetic key event
# carries no Shift press): the guest's uptime when it ran, kept in its memory
TYPED = "cp /proc/uptime /tmp/typed"
READ = "cat /tmp/typed 2>/dev/null; true"

# each (phase, state) the progress shows, in order, with the console's state at that moment
RECORDER = """() => {
  window.__phases = [];
  new MutationObserver(() => {
    for (const li of document.querySelectorAll("#migrate-dialog ol.phases li")) {
      const seen = [li.dataset.phase, li.dataset.state];
      const last = window.__phases.filter((p) => p[0] === seen[0]).pop();
      if (!last || last[1] !== seen[1]) {
        window.__phases.push([...seen, document.querySelector("#console-state").dataset.state,
          Math.round(performance.now())]);
      }
    }
  }).observe(document.body, { subtree: true, childList: true, attributes: true });
}"""

MEMORY_PHASE = '#migrate-dialog li[data-phase="memory"]'


def _overlap(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"]
            and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"])


def test_the_console_takes_keys_during_pre_copy_then_follows(fresh, browser, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    a, b, name = fresh
    a.capsule("start", name)
    a.guest(name, DIRTIER)
    a.guest(name, SCREEN_SHELL)
    home = known_as(a, "home", b)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(a.url)
    page.fill("#token", a.token)
    page.click("#sign-in-form button[type=submit]")
    row = page.locator(f'section[data-host="local"] tr[data-capsule="{name}"]')
    expect(row.locator(".badge")).to_have_attribute("data-state", "running", timeout=30_000)
    expect(page.locator(f'section[data-host="{home}"]')).to_have_attribute("data-reachable", "yes", timeout=30_000)
    page.evaluate(RECORDER)

    # its console, open here
    panel, state = page.locator("#console"), page.locator("#console-state")
    row.locator('button[data-action="console"]').click()
    expect(state).to_have_attribute("data-state", "connected", timeout=30_000)

    row.locator('button[data-action="migrate"]').click()
    dialog = page.locator("#migrate-dialog")
    page.select_option("#migrate-to", home)
    live = dialog.locator('input[name="kind"][value="live"]')
    expect(live).to_be_enabled(timeout=30_000)       # two hosts: the pre-check lets it move live
    expect(live).to_be_checked()
    dialog.locator('[data-action="start-migration"]').click()

    # pre-copy: the guest's memory travels while it runs; the console here is still on it and takes keys
    expect(page.locator(MEMORY_PHASE)).to_have_attribute("data-state", "current", timeout=300_000)
    expect(state).to_have_attribute("data-state", "connected")
    page.locator("#console-screen canvas").click(timeout=15_000)
    page.keyboard.type(TYPED, delay=30)
    page.keyboard.press("Enter")
    # every key went to the console here before the switchover began: during pre-copy
    assert page.locator(MEMORY_PHASE).get_attribute("data-state") == "current", page.evaluate("window.__phases")
    expect(state).to_have_attribute("data-state", "connected")
    assert not _overlap(dialog.bounding_box(), panel.bounding_box()), "the progress covers the console"
    # the rounds are shown as they go: bytes per round and the guest's dirty rate
    rounds = dialog.locator('[data-field="rounds"] tr[data-round]')
    expect(rounds.first).to_be_visible(timeout=60_000)
    page.screenshot(path=str(tmp_path / "pre-copy.png"), full_page=True)

    message = dialog.locator(".migrate-message")
    expect(message).to_have_attribute("data-outcome", "done", timeout=600_000)
    expect(message).to_contain_text(f"now runs on {home}")
    expect(dialog.locator('li[data-phase="switchover"] [data-field="phase-detail"]')).to_contain_text("paused")
    expect(message).to_contain_text("The console follows it there.")
    wire = dialog.locator('[data-field="rounds"] tr[data-round] td:nth-child(3)').all_inner_texts()
    assert any(w != "0 B" for w in wire), wire                       # what each round put on the wire
    rates = rounds.locator("td:nth-child(4)").all_inner_texts()
    assert any("pages/s" in r for r in rates), rates                 # the guest's dirty rate, once measured
    # nothing clicked since: the console is on the capsule at the destination
    expect(state).to_have_attribute("data-state", "connected", timeout=30_000)
    expect(panel).to_have_attribute("data-peer", home)
    seen = page.evaluate("window.__phases")
    # the console was connected here when pre-copy began, and all through it (checked above, after typing); it
    # went with the guest at the switchover, which can come before the page hears that pre-copy ended
    print(f"\nphases (phase, state, console, ms): {seen}")
    assert [c for p, s, c, _ in seen if (p, s) == ("memory", "current")] == ["connected"], seen
    page.screenshot(path=str(tmp_path / "moved.png"), full_page=True)
    # the panel is reached with the keyboard: from its title, Tab goes to Close, and Enter closes it
    page.focus("#migrate-title")
    page.keyboard.press("Tab")
    expect(dialog.locator('[data-action="close-migration"]')).to_be_focused()
    page.keyboard.press("Enter")
    expect(dialog).to_be_hidden()

    # the keystrokes typed during pre-copy reached the guest: what they wrote is there, on the destination
    assert b.state(name) == "running"
    uptime = b.guest(name, READ).split()
    assert len(uptime) == 2 and float(uptime[0]) > 0, uptime
    b.capsule("stop", name, "--force")
