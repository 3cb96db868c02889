"""The backups panel in a real browser: a schedule with its last result, "Back up now", the backup in its
list, "Restore…" as a new capsule that starts, "Verify now" with its result, and a backup host shown with
its own policy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from capsule import capsules, hosts, lifecycle
from capsule.backup import jobs, verifyjob
from capsule.backup.retention import Policy
from tests.browser.test_dashboard import SCREENSHOTS, browser  # noqa: F401 - the shared browser fixture
from tests.helpers.guest import run

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]


def test_back_up_restore_and_verify_from_the_page(two_hosts, browser, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    a, b, agent_a, agent_b = two_hosts
    hosts.add(a, "vault", agent_b.url, agent_b.token)
    capsules.create(a, "desk", "tiny", memory="256M")
    lifecycle.start(a, "desk")
    run(a, "desk", "echo from-tuesday > /tmp/note")
    jobs.schedule(a, "desk", "mon..fri 21:00", Policy(daily=7), target="vault", target_policy=Policy(daily=30))
    verifyjob.schedule(a, "Sun 04:00")

    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(agent_a.url)
    page.fill("#token", agent_a.token)
    page.click("#sign-in-form button[type=submit]")
    row = page.locator('#backups tr[data-job="desk"]')
    expect(row).to_contain_text("keep-daily 7")
    expect(row).to_contain_text("keeps keep-daily 30")
    expect(row.locator("summary")).to_have_text("0 backups")

    row.locator('[data-action="backup-now"]').click()
    expect(row.locator('[data-result="ok"]')).to_be_visible(timeout=120_000)
    expect(row.locator("summary")).to_have_text("1 backup")
    [version] = [v.number for v in jobs.backups(a, "desk")]
    assert b.catalogue.version("desk", version) is not None          # copied to the backup host

    run(a, "desk", "echo from-wednesday > /tmp/note")
    row.locator("summary").click()
    item = row.locator(f'li[data-backup="desk@{version}"]')
    item.locator('[data-action="restore"]').click()
    dialog = page.locator("#restore-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#restore-as")).to_have_value(f"desk-{version}")
    page.fill("#restore-as", "desk-tuesday")
    dialog.locator('button[value="ok"]').click()
    restored = page.locator('section[data-host="local"] tr[data-capsule="desk-tuesday"] .badge')
    expect(restored).to_have_attribute("data-state", "running", timeout=120_000)
    assert run(a, "desk-tuesday", "cat /tmp/note") == "from-tuesday"         # as it was at the backup
    assert run(a, "desk", "cat /tmp/note") == "from-wednesday"               # and desk goes on as it was

    page.locator('[data-action="verify-backups"]').click()
    expect(page.locator("#backups .verify")).to_have_attribute("data-verify", "ok", timeout=120_000)
    assert verifyjob.get(a).last_result == "ok"
    shot = tmp_path / "backups.png"
    page.locator("#backups").screenshot(path=str(shot))
    if SCREENSHOTS:
        shutil.copyfile(shot, Path(SCREENSHOTS) / "backups.png")

    # a failing run is shown with its reason
    agent_b.stop()
    row.locator('[data-action="backup-now"]').click()
    expect(row.locator('[data-result="not copied"]')).to_be_visible(timeout=120_000)
    expect(page.locator("#alert")).to_contain_text("backup of desk failed")
