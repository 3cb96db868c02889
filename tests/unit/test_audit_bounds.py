"""The audit log cannot fill the disk: a flood of refused calls is one line and a count (successful changes are
still each their own line), the log is rotated at its size cap keeping a few files, two writers at once neither
lose nor tear lines across a rotation, and `capsule audit` reads across the rotated files and the summaries."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from capsule import audit
from capsule.agent.app import create_app
from capsule.errors import InvalidName
from capsule.store import Store
from tests.unit.test_accounts_agent import OTHER, SECRET, TOKEN, Clock, make_home
from tests.unit.test_accounts_cli import run  # noqa: F401 - the fixture

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

DERIVE = f"/api/capsules/{SECRET}/derive"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


MAX_SIZE, KEEP = "CAPSULE_AUDIT_MAX_SIZE", "CAPSULE_AUDIT_KEEP"


def log_files(home) -> list[Path]:
    """audit.log.N … audit.log.1, audit.log: oldest first."""
    rotated = sorted(home.glob("audit.log.[0-9]*"), key=lambda p: -int(p.name.rsplit(".", 1)[1]))
    return rotated + [p for p in [home / "audit.log"] if p.exists()]


def raw_lines(home) -> list[dict]:
    return [json.loads(x) for p in log_files(home) for x in p.read_text().splitlines()]


@pytest.fixture
def home(tmp_path):
    return make_home(tmp_path)


def test_a_flood_of_refusals_is_one_line_and_a_count_changes_stay_one_line_each(home):
    client = TestClient(create_app(home, TOKEN))
    start = time.time()
    for _ in range(300):                  # refused anonymous POSTs from one address, within the window
        assert client.post(DERIVE, json={"child": "x"}).status_code == 401
    assert len(raw_lines(home)) == 1                                    # O(1) lines, not 300
    for child in ("kid1", "kid2"):                                      # changes: one line each
        assert client.post(DERIVE, json={"child": child}, headers=AUTH).status_code == 200
    got = raw_lines(home)
    assert [(e["who"], e["result"], e.get("repeated")) for e in got] == [
        ("anonymous", "auth_failed", None), ("anonymous", "auth_failed", 299),
        ("host-token", "ok", None), ("host-token", "ok", None)]
    summary = got[1]
    assert start <= got[0]["time"] <= summary["first"] <= summary["last"] == summary["time"] <= time.time()
    assert summary["from"] == "testclient" and summary["action"] == "POST /api/capsules/{name}/derive"
    assert "299 more times between" in audit.describe(summary)

    # a distinct refusal is its own line; a window that closed is summarised by the next call after it
    from capsule.agent.auditlog import AuditLog

    app = create_app(home, TOKEN)
    clock = Clock()
    app.state.audit_log = AuditLog(home, window=300, clock=clock, timers=False)
    client = TestClient(app)
    for _ in range(3):
        client.post(f"/api/capsules/{OTHER}/rm", json={})
        client.post(DERIVE, json={"child": "x"})
    clock.now += 301
    client.post(DERIVE, json={"child": "y"})
    assert [(e["action"].split()[1], e["result"], e.get("repeated")) for e in raw_lines(home)[4:]] == [
        ("/api/capsules/{name}/rm", "auth_failed", None), ("/api/capsules/{name}/derive", "auth_failed", None),
        ("/api/capsules/{name}/rm", "auth_failed", 2), ("/api/capsules/{name}/derive", "auth_failed", 2),
        ("/api/capsules/{name}/derive", "auth_failed", None)]


def test_the_summary_is_written_when_the_window_closes_with_no_other_call(home):
    from capsule.agent.auditlog import AuditLog

    app = create_app(home, TOKEN)
    clock = Clock()          # stands still while the calls come, however long they take on a loaded machine
    app.state.audit_log = AuditLog(home, window=0.5, clock=clock)
    client = TestClient(app)
    for _ in range(20):
        client.post(DERIVE, json={"child": "x"})
    assert len(raw_lines(home)) == 1
    clock.now += 1           # the window has closed: the timer (armed for 0.55 s) writes the summary, no call
    deadline = time.monotonic() + 20
    while len(raw_lines(home)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [e.get("repeated") for e in raw_lines(home)] == [None, 19]


def test_the_log_is_rotated_at_its_cap_keeping_n_files_and_read_across_them(home, monkeypatch, run):  # noqa: F811
    monkeypatch.setenv(MAX_SIZE, "4K")
    monkeypatch.setenv(KEEP, "3")
    client = TestClient(create_app(home, TOKEN))
    for i in range(60):
        assert client.post(DERIVE, json={"child": f"kid{i}"}, headers=AUTH).status_code == 200
    files = log_files(home)
    assert [p.name for p in files] == ["audit.log.2", "audit.log.1", "audit.log"]
    assert all(p.stat().st_size <= 4096 for p in files)
    kids = [e for e in audit.entries(home) if e["result"] == "ok"]
    assert 20 <= len(kids) < 60                                # the oldest file went; three files' worth stayed
    r = run(home, "--json", "audit")
    got = json.loads(r.output[r.output.index("["):])
    assert len(got) == len(kids) and all(e["via"] == "agent" for e in got)
    # the CLI's own lines go through the same rotation, into the same files
    r = run(home, "user", "add", "carol", "--role", "owner", "--no-password")
    assert r.exit_code == 0 and list(audit.entries(home))[-1]["action"] == "capsule user add carol"
    assert len(log_files(home)) == 3


def test_two_writers_at_once_lose_nothing_across_rotations(tmp_path, monkeypatch):
    monkeypatch.setenv(MAX_SIZE, "64K")
    monkeypatch.setenv(KEEP, "12")

    def writer(name: str) -> None:
        for i in range(600):
            audit.record(tmp_path, who=name, action=f"POST /x/{i}", remote="::1")

    threads = [threading.Thread(target=writer, args=(f"w{n}",)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    files = log_files(tmp_path)
    assert 3 <= len(files) <= 12 and all(p.stat().st_size <= 64 << 10 for p in files)
    got = [(e["who"], e["action"]) for e in audit.entries(tmp_path)]
    assert all("damaged" not in e for e in audit.entries(tmp_path))
    for n in range(3):             # each writer's lines all there, once, in its order
        assert [a for w, a in got if w == f"w{n}"] == [f"POST /x/{i}" for i in range(600)]


def test_a_bad_rotation_setting_is_refused_clearly_and_changes_nothing(home, monkeypatch, run):  # noqa: F811
    monkeypatch.setenv(MAX_SIZE, "lots")
    with pytest.raises(InvalidName, match="CAPSULE_AUDIT_MAX_SIZE='lots': give a size such as 16M"):
        create_app(home, TOKEN)
    r = run(home, "user", "add", "carol", "--role", "owner", "--no-password")
    assert r.exit_code == 2 and "CAPSULE_AUDIT_MAX_SIZE" in r.output
    store = Store.open(home)
    assert not store.catalogue.query("SELECT 1 FROM sqlite_master WHERE name='users'") or \
        not store.catalogue.query("SELECT 1 FROM users WHERE name='carol'")
    store.close()
    monkeypatch.setenv(MAX_SIZE, "16M")
    monkeypatch.setenv(KEEP, "1")
    with pytest.raises(InvalidName, match="keep between 2 and 1000"):
        create_app(home, TOKEN)
    assert not log_files(home)
