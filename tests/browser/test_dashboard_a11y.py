"""The dashboard's accessibility and layout in a real browser, on two hosts of this machine: axe-core (the npm
package in web/, injected into the page) finds no serious or critical violation on the sign-in form, the capsule
lists, a capsule's screen and serial console, the backups panel and the migrate, derive, remove and restore
dialogs; at 1024, 1280 and 1920 px wide no control sticks out of its card; and the page works from the keyboard
alone: Tab reaches sign-in and a capsule's Start, Console and Migrate…, each shows where the focus is, the
list's refresh every few seconds keeps the focus where it was, and an opened console's screen takes the keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from capsule import capsules, hosts, lifecycle
from capsule.backup import jobs
from capsule.backup.retention import Policy
from tests.browser.test_dashboard import _shot, browser  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(400)]

AXE = Path(__file__).resolve().parents[2] / "web" / "node_modules" / "axe-core" / "axe.min.js"

# axe-core's serious and critical violations on the page as it is: "rule: node, node, …"
AXE_RUN = """async () => {
  const r = await axe.run(document, { resultTypes: ["violations"] });
  return r.violations.filter((v) => v.impact === "serious" || v.impact === "critical")
    .map((v) => `${v.id} (${v.impact}): ${v.nodes.slice(0, 6).map((n) => n.target.join(" ")).join(", ")}`);
}"""

# every visible control that sticks out of its card (or dialog) by more than a pixel, with by how much
OVERFLOW = """() => {
  const out = [];
  for (const el of document.querySelectorAll("button, input, select, textarea, a, summary")) {
    const box = el.closest(".card, dialog");
    if (!box || !el.getClientRects().length) continue;
    const r = el.getBoundingClientRect(), b = box.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    const over = Math.max(b.left - r.left, r.right - b.right, b.top - r.top, r.bottom - b.bottom);
    if (over > 1) out.push(`${el.tagName.toLowerCase()}${el.id ? "#" + el.id : ""}[${el.textContent.trim()
      || el.getAttribute("data-action") || ""}] in ${box.id || box.className}: ${Math.round(over)} px`);
  }
  if (document.documentElement.scrollWidth > window.innerWidth + 1) {
    out.push(`the page scrolls sideways: ${document.documentElement.scrollWidth} > ${window.innerWidth}`);
  }
  return out;
}"""

# the focused element ("tag#id[data-action]@capsule") and whether it shows a focus indicator: an outline or a
# box-shadow of at least 2 px
FOCUSED = """() => {
  const el = document.activeElement;
  if (!el || el === document.body) return null;
  const s = getComputedStyle(el);
  const outline = s.outlineStyle !== "none" && parseFloat(s.outlineWidth) >= 2;
  const shadow = s.boxShadow && s.boxShadow !== "none";
  const row = el.closest("tr[data-capsule]");
  return { what: `${el.tagName.toLowerCase()}${el.id ? "#" + el.id : ""}`
      + `${el.dataset.action ? "[" + el.dataset.action + "]" : ""}${row ? "@" + row.dataset.capsule : ""}`,
    visible: outline || Boolean(shadow) };
}"""


# whether the console's screen (noVNC's canvas) has the focus, and the ring its panel shows then
SCREEN_FOCUSED = """() => {
  const screen = document.querySelector("#console-screen");
  const s = getComputedStyle(screen);
  return { canvas: document.activeElement === screen.querySelector("canvas"),
    ring: s.outlineStyle === "none" ? "none" : s.outlineWidth };
}"""


@pytest.fixture
def dashboard(two_hosts):
    """Host A with a running capsule ("desk") and a stopped one ("idle"), a backup schedule for desk, host B as its
    peer "home"."""
    a, b, agent_a, agent_b = two_hosts
    capsules.create(a, "desk", "tiny", memory="256M")
    capsules.create(a, "idle", "tiny", memory="256M")
    capsules.create(b, "far", "tiny", memory="256M")
    lifecycle.start(a, "desk")
    hosts.add(a, "home", agent_b.url, agent_b.token)
    jobs.schedule(a, "desk", "mon..fri 21:00", Policy(daily=7), mode="disk-only")
    return agent_a


def _axe(page) -> list[str]:
    if not AXE.exists():
        pytest.fail(f"{AXE} is missing: install the page's npm packages (`make web`)")
    if not page.evaluate("() => typeof axe !== 'undefined'"):
        page.evaluate(AXE.read_text())
    return page.evaluate(AXE_RUN)


def _listed(page) -> None:
    from playwright.sync_api import expect

    expect(page.locator('tr[data-capsule="desk"] .badge')).to_have_attribute("data-state", "running")
    expect(page.locator('section[data-host="home"] tr[data-capsule="far"]')).to_be_visible()


def _sign_in(page, agent) -> None:
    page.fill("#token", agent.token)
    page.click("#sign-in-form button[type=submit]")
    _listed(page)


def test_axe_finds_no_serious_violation(dashboard, browser, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(dashboard.url)
    expect(page.locator("#sign-in")).to_be_visible()
    found = {"sign-in": _axe(page)}
    _sign_in(page, dashboard)
    page.locator("#tree-view svg").wait_for()
    found["capsule lists"] = _axe(page)
    page.locator('tr[data-capsule="desk"] button[data-action="console"]').click()
    expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=30_000)
    found["console"] = _axe(page)
    page.locator('tr[data-capsule="desk"] button[data-action="migrate"]').click()
    expect(page.locator("#migrate-dialog")).to_be_visible()
    expect(page.locator("#migrate-to option")).not_to_have_count(0)
    found["migrate dialog"] = _axe(page)
    _shot(page, tmp_path, "dashboard-a11y")
    page.keyboard.press("Escape")
    for action, dialog in (("derive", "#derive-dialog"), ("rm", "#rm-dialog")):
        page.locator(f'tr[data-capsule="idle"] button[data-action="{action}"]').click()
        expect(page.locator(dialog)).to_be_visible()
        found[f"{action} dialog"] = _axe(page)
        page.keyboard.press("Escape")
        expect(page.locator(dialog)).to_be_hidden()
    row = page.locator('#backups tr[data-job="desk"]')            # a backup, then the restore dialog
    row.locator('[data-action="backup-now"]').click()
    expect(row.locator('[data-result="ok"]')).to_be_visible(timeout=120_000)
    row.locator("summary").click()
    row.locator('[data-action="restore"]').first.click()
    expect(page.locator("#restore-dialog")).to_be_visible()
    found["backups, restore dialog"] = _axe(page)
    page.keyboard.press("Escape")
    page.locator("#console-kind-serial").click()
    expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=30_000)
    found["serial console"] = _axe(page)
    assert {view: v for view, v in found.items() if v} == {}


@pytest.mark.parametrize("width", [1024, 1280, 1920])
def test_no_control_overflows_its_card(dashboard, browser, tmp_path, width):  # noqa: F811
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": width, "height": 900})
    page.goto(dashboard.url)
    expect(page.locator("#sign-in")).to_be_visible()
    assert page.evaluate(OVERFLOW) == []
    _sign_in(page, dashboard)
    page.locator('tr[data-capsule="desk"] details summary').click()     # a version list unfolded
    page.locator('tr[data-capsule="desk"] button[data-action="console"]').click()
    expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=30_000)
    _shot(page, tmp_path, f"dashboard-{width}")
    assert page.evaluate(OVERFLOW) == []
    page.locator('tr[data-capsule="desk"] button[data-action="migrate"]').click()
    expect(page.locator("#migrate-dialog")).to_be_visible()
    assert page.evaluate(OVERFLOW) == []


def _tab_to(page, want: str, limit: int = 150, key: str = "Tab") -> list[str]:
    """Tab (or ``key``) until ``want`` has the focus; every stop on the way (each must show its focus)."""
    seen = []
    for _ in range(limit):
        page.keyboard.press(key)
        f = page.evaluate(FOCUSED)
        if f is None:
            continue
        assert f["visible"], f"{f['what']} has the focus and does not show it"
        seen.append(f["what"])
        if f["what"] == want:
            return seen
    raise AssertionError(f"Tab never reached {want}: {seen}")


def test_keyboard_alone(dashboard, browser):  # noqa: F811
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(dashboard.url)
    expect(page.locator("#sign-in")).to_be_visible()
    _tab_to(page, "input#token")
    page.keyboard.type(dashboard.token)
    _tab_to(page, "button")                                   # the form's Sign in
    page.keyboard.press("Enter")
    _listed(page)

    for target in ("button[console]@desk", "button[migrate]@desk", "button[start]@idle"):
        _tab_to(page, target)
        # the lists are redrawn every 3 s: the focus stays on the same button, and shows
        stamp = page.locator("#refreshed").text_content()
        expect(page.locator("#refreshed")).not_to_have_text(stamp or "", timeout=10_000)
        assert page.evaluate(FOCUSED) == {"what": target, "visible": True}
        if target == "button[migrate]@desk":
            page.keyboard.press("Enter")                      # Migrate… from the keyboard
            expect(page.locator("#migrate-dialog")).to_be_visible()
            page.keyboard.press("Escape")
            expect(page.locator("#migrate-dialog")).to_be_hidden()

    # back to Console: Enter opens the screen, which takes the keys (and shows it)
    _tab_to(page, "button[console]@desk", key="Shift+Tab")
    page.keyboard.press("Enter")
    expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=30_000)
    assert page.evaluate(SCREEN_FOCUSED) == {"canvas": True, "ring": "3px"}
