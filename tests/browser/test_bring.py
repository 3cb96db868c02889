"""Bring it here, in a real browser (Debian's chromium driven by Playwright), between two hosts on this machine
with a real guest: opened on host A's page, a capsule running on host B is brought to A with the Bring here button
of B's row; the phases advance, it ends up running on A (A's list shows it, its counter goes on) and the console
hook is called for A. While B does not know A, the button is greyed out, saying what to add there."""

from __future__ import annotations

import pytest

from capsule import capsules, hosts
from capsule.runtime.connection import lookup_domain
from tests.browser.test_dashboard import browser  # noqa: F401 - fixture
from tests.browser.test_migrate import RECORDER, _running, _signed_in
from tests.helpers.guest import count, wait_count_above

pytestmark = [pytest.mark.browser, pytest.mark.timeout(400)]


def test_bring_it_here(two_hosts, browser):  # noqa: F811
    from playwright.sync_api import expect

    a, b, agent_a, agent_b = two_hosts
    before = _running(b, "desk")
    hosts.add(a, "office", agent_b.url, agent_b.token)
    page = _signed_in(browser, agent_a)
    row = page.locator('section[data-host="office"] tr[data-capsule="desk"]')
    expect(row.locator(".badge")).to_have_attribute("data-state", "running", timeout=30_000)
    # B does not know A yet: greyed out, naming what to add there
    button = row.locator('button[data-action="bring"]')
    expect(button).to_have_attribute("data-refused", "unknown_destination", timeout=30_000)
    expect(button).to_be_disabled()
    expect(row.locator('[data-field="bring-refused"]')).to_contain_text("capsule host add")

    hosts.add(b, "home", agent_a.url, agent_a.token)
    page.reload()
    expect(button).to_be_enabled(timeout=30_000)
    page.evaluate(RECORDER)
    button.click()
    dialog = page.locator("#bring-dialog")
    expect(dialog).to_be_visible()
    # both hosts are this machine's one libvirtd: B's pre-check greys Live out, with its reason
    expect(dialog.locator('input[name="kind"][value="live"]')).to_be_disabled(timeout=30_000)
    expect(dialog.locator('[data-kind="live"]')).to_have_attribute("data-refused", "same_host")
    dialog.locator('input[name="kind"][value="full"]').check()
    dialog.locator('[data-action="start-bring"]').click()

    progress = page.locator("#migrate-dialog")
    expect(progress.locator(".migrate-progress h3")).to_have_text("Bringing desk here from office")
    message = progress.locator(".migrate-message")
    expect(message).to_have_attribute("data-outcome", "done", timeout=240_000)
    expect(message).to_contain_text("now runs here (it came from office)")
    for li in progress.locator("ol.phases li").all():
        expect(li).to_have_attribute("data-state", "done")
    seen = page.evaluate("window.__phases")
    assert [p for p, s in seen if s == "current"] == ["save", "memory", "disk", "resume"], seen
    assert page.evaluate("window.__followed") == [None, "desk"]      # the console opens on it here

    progress.locator('[data-action="close-migration"]').click()
    here = page.locator('section[data-host="local"] tr[data-capsule="desk"] .badge')
    expect(here).to_have_attribute("data-state", "running", timeout=30_000)
    expect(row.locator(".badge")).not_to_have_attribute("data-state", "running", timeout=30_000)
    assert lookup_domain(b.domain_name("desk")) is None and lookup_domain(a.domain_name("desk")) is not None
    after = count(a, "desk")
    assert before <= after and wait_count_above(a, "desk", after) > after


def test_a_peers_hierarchy_on_this_hosts_page(two_hosts, browser):  # noqa: F811
    """Which versions exist where: the tree card shows a peer's hierarchy too, picked by its name."""
    from playwright.sync_api import expect

    a, b, agent_a, agent_b = two_hosts
    capsules.create(b, "desk", "tiny", memory="256M")
    capsules.derive(b, "desk", "kid")
    capsules.create(a, "here", "tiny", memory="256M")
    hosts.add(a, "office", agent_b.url, agent_b.token)
    page = _signed_in(browser, agent_a)
    view = page.locator("#tree-view")
    expect(view.locator('[data-node="version:here@1"]')).to_have_count(1, timeout=30_000)
    picker = page.locator("#tree-host")
    expect(picker.locator('option[value="office"]')).to_have_count(1, timeout=30_000)
    picker.select_option("office")
    expect(page.locator("#tree h2")).to_have_text("Hierarchy on office")
    expect(view.locator('[data-node="version:desk@1"]')).to_have_count(1, timeout=30_000)
    expect(view.locator('[data-node="version:kid@1"]')).to_have_count(1)
    expect(view.locator('[data-node="version:here@1"]')).to_have_count(0)
    page.wait_for_timeout(4000)        # a refresh later it still shows the peer's
    expect(view.locator('[data-node="version:desk@1"]')).to_have_count(1)
    picker.select_option("")
    expect(page.locator("#tree h2")).to_have_text("Hierarchy on this host")
    expect(view.locator('[data-node="version:here@1"]')).to_have_count(1, timeout=30_000)
    expect(view.locator('[data-node="version:desk@1"]')).to_have_count(0)
