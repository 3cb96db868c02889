"""The backup verify job without guests: its schedule (checked before it is written, once per slot),
bad input to the CLI and to the agent's verify route, and a store with no backups."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
from typer.testing import CliRunner

from capsule.backup import verifyjob
from capsule.backup.calendar import CalendarError
from capsule.errors import NotFound
from capsule.store import Store
from capsule.store.catalogue import CapsuleRow, VersionRow
from tests.helpers.inprocess_agent import InProcessAgent

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 23, 10, 0, tzinfo=UTC).timestamp()


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "s")
    s.catalogue.add_capsule(CapsuleRow("desk", "u-1", "tiny", None, None, T0))
    s.catalogue.add_version(VersionRow("desk", 1, None, None, None, [], {"kernel": "k", "initrd": "i"},
                                       "created", T0))
    yield s
    s.close()


def test_schedule_is_checked_and_due_once_per_slot(store):
    with pytest.raises(CalendarError):
        verifyjob.schedule(store, "*:61", now=T0)
    assert verifyjob.get(store) is None
    with pytest.raises(NotFound):
        verifyjob.unschedule(store)
    job = verifyjob.schedule(store, "hourly", now=T0)
    assert job.calendar == "hourly" and job.next_run == T0 + 3600
    assert not verifyjob.due(store, T0 + 3599)
    assert verifyjob.due(store, T0 + 3600 * 5 + 10)       # missed slots: once
    assert not verifyjob.due(store, T0 + 3600 * 5 + 20)
    assert verifyjob.get(store).next_run == T0 + 3600 * 6
    assert verifyjob.schedule(store, "daily", now=T0).calendar == "daily"    # replaces it
    verifyjob.unschedule(store)
    assert verifyjob.get(store) is None


def test_a_store_without_backups_verifies_nothing_and_is_good(store):
    result = verifyjob.run(store)
    assert result.ok and [h.host for h in result.hosts] == ["here"] and result.hosts[0].backups == []
    assert result.hosts[0].checked_layers == result.hosts[0].checked_files == 0
    with pytest.raises(NotFound):
        verifyjob.run(store, ["ghost"])


@pytest.mark.parametrize(("args", "needle"), [
    (["verify", "--every", "daily", "--unschedule"], "not both"),
    (["verify", "--every", "*:61"], "minute 61"),
    (["verify", "--unschedule"], "no verify job"),
    (["verify", "ghost"], "no capsule named 'ghost'"),
])
def test_cli_bad_input(store, args, needle):
    from capsule.cli.main import app

    r = CliRunner().invoke(app, ["--home", str(store.home), "backup", *args])
    assert r.exit_code != 0
    assert needle in str(r.exception), r.output
    assert verifyjob.get(store) is None


@pytest.mark.parametrize("body", [b"[]", b'{"versions": "desk@1"}', b'{"versions": [1]}', b"{nope",
                                  b'{"versions": ["../etc@1"]}'])
def test_the_verify_route_refuses_malformed_requests(store, body):
    agent = InProcessAgent(store.home, "t0ken-sixteen-chars")
    try:
        r = httpx.post(f"{agent.url}/v1/verify", content=body, headers={"Authorization": "Bearer t0ken-sixteen-chars"})
        assert r.status_code in (400, 404), r.text
        assert r.json()["error"] in ("invalid_name", "not_found")
        assert httpx.post(f"{agent.url}/v1/verify", content=b'{"versions": []}').status_code == 401
    finally:
        agent.stop()


def test_a_version_the_host_lacks_is_a_problem_of_its_own(store):
    agent = InProcessAgent(store.home, "t0ken-sixteen-chars")
    try:
        r = httpx.post(f"{agent.url}/v1/verify", json={"versions": ["desk@9", "desk@1"]},
                       headers={"Authorization": "Bearer t0ken-sixteen-chars"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert not body["ok"] and body["problems"] == [{"kind": "missing", "id": "desk@9",
                                                        "error": "this host has no such version"}]
        assert body["used_by"] == {"desk@9": []}
    finally:
        agent.stop()


def test_a_backup_hosts_policy_is_parsed_checked_and_kept(store):
    from capsule import hosts  # noqa: F401 - (the target must be a known host)
    from capsule.backup import jobs
    from capsule.backup.retention import Policy, PolicyError

    assert Policy.parse("daily=30, weekly=12,keep-monthly=24,within=1y") == Policy(daily=30, weekly=12, monthly=24,
                                                                                   within="1y")
    for bad in ("", "daily", "daily=x", "hourly=-1", "fortnightly=2", "within=soon", "daily=١"):
        with pytest.raises(PolicyError):
            Policy.parse(bad)
    with pytest.raises(Exception, match="needs a backup host"):
        jobs.schedule(store, "desk", "daily", Policy(last=1), target_policy=Policy(daily=30), now=T0)
    assert jobs.jobs(store) == []


def test_a_catalogue_from_before_the_backup_hosts_policy_still_works(tmp_path):
    import sqlite3

    from capsule.backup import jobs
    from capsule.backup.retention import Policy

    s = Store.open(tmp_path / "old")
    s.catalogue.add_capsule(CapsuleRow("desk", "u-1", "tiny", None, None, T0))
    s.close()
    db = sqlite3.connect(tmp_path / "old" / "catalogue.sqlite")
    db.execute("DROP TABLE backup_jobs")     # as a catalogue made before the column: 0.1.0's first table, no version
    db.execute("CREATE TABLE backup_jobs(capsule TEXT PRIMARY KEY, calendar TEXT NOT NULL, policy TEXT NOT NULL, "
               "mode TEXT NOT NULL, target TEXT, created REAL NOT NULL, next_run REAL, running_since REAL, "
               "running_by TEXT, last_run REAL, last_result TEXT, last_duration REAL, last_bytes INTEGER, "
               "last_pause REAL, last_version INTEGER, last_error TEXT)")
    db.execute("PRAGMA user_version = 0")
    db.execute("INSERT INTO backup_jobs(capsule, calendar, policy, mode, created, next_run) "
               "VALUES('desk', 'daily', '{\"last\": 2}', 'memory', ?, ?)", (T0, T0 + 50400))
    db.commit()
    db.close()
    s = Store.open(tmp_path / "old")
    try:
        [job] = jobs.jobs(s)
        assert job.policy == Policy(last=2) and job.target_policy is None and job.there_policy == Policy(last=2)
    finally:
        s.close()


@pytest.mark.parametrize("body", [b"[]", b'{"policy": "daily=3"}', b'{"policy": {"daily": -1}}',
                                  b'{"policy": {"fortnightly": 2}}', b'{"policy": {"daily": 1}, "x": 1}'])
def test_the_prune_route_refuses_malformed_requests(store, body):
    agent = InProcessAgent(store.home, "t0ken-sixteen-chars")
    try:
        r = httpx.post(f"{agent.url}/v1/backups/desk/prune", content=body,
                       headers={"Authorization": "Bearer t0ken-sixteen-chars"})
        if body.endswith(b'"x": 1}'):          # unknown keys beside a good policy are ignored
            assert r.status_code == 200 and r.json()["removed"] == []
        else:
            assert r.status_code == 400 and r.json()["error"] in ("invalid_name", "policy_error"), r.text
        r = httpx.post(f"{agent.url}/v1/backups/-x/prune", content=b'{"policy": {"daily": 1}}',
                       headers={"Authorization": "Bearer t0ken-sixteen-chars"})
        assert r.status_code == 400 and r.json()["error"] == "invalid_name", r.text
    finally:
        agent.stop()
