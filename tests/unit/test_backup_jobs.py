"""Backup schedules, runs and the scheduler, in-process: a bare store whose capsule versions are catalogue
rows, a snapshot taker that records a backup version (or fails), and an injected clock."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner

from capsule.backup import jobs, runner
from capsule.backup.calendar import CalendarError
from capsule.backup.retention import Policy
from capsule.backup.scheduler import Scheduler
from capsule.errors import Conflict, NotFound
from capsule.store import Store
from capsule.store.catalogue import CapsuleRow, VersionRow

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 23, 10, 0, tzinfo=UTC).timestamp()   # a Monday, 10:00 UTC


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "s")
    s.catalogue.add_capsule(CapsuleRow("desk", "u-1", "tiny", None, None, T0))
    s.catalogue.add_version(VersionRow("desk", 1, None, None, None, [], {"kernel": "k", "initrd": "i"},
                                       "created", T0))
    yield s
    s.close()


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Taker:
    """Records a backup version at the clock's time; can be told to fail or to block."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.calls: list[float] = []
        self.fail: str | None = None
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def __call__(self, store, name, mode, say):
        self.calls.append(self.clock())
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test never opened the gate"
        if self.fail:
            raise Conflict(self.fail)
        cat = store.catalogue
        with cat.transaction():
            v = VersionRow(name, cat.next_version_number(name), name, None, None, [], {"kernel": "k", "initrd": "i"},
                           jobs.backup_note(mode, "memory"), self.clock())
            cat.add_version(v)
        return runner.Taken(v, 1000, 0.25, "memory")


def _job(store, name="desk"):
    return jobs.get(store, name)


def test_schedule_records_next_run_and_rescheduling_changes_it(store):
    job, created = jobs.schedule(store, "desk", "*:0/15 UTC", Policy(last=3), now=T0 + 60)
    assert created and job.next_run == T0 + 15 * 60 and job.mode == "memory"
    assert job.as_dict()["normalized"] == "*-*-* *:00/15:00 UTC"
    job, created = jobs.schedule(store, "desk", "hourly UTC", Policy(daily=7), now=T0 + 60)
    assert not created and job.next_run == T0 + 3600 and job.policy == Policy(daily=7)
    assert [j.capsule for j in jobs.jobs(store)] == ["desk"]
    jobs.unschedule(store, "desk")
    assert jobs.jobs(store) == []


@pytest.mark.parametrize(("name", "every", "kwargs", "error", "needle"), [
    ("ghost", "daily", {}, NotFound, "no capsule named 'ghost'"),
    ("desk", "mon..fry 21:00", {}, CalendarError, "'fry' is not a weekday"),
    ("desk", "2003-03-05", {}, CalendarError, "never elapses"),
    ("desk", "daily", {"mode": "both"}, Conflict, "unknown backup mode"),
    ("desk", "daily", {"target": "nowhere"}, NotFound, "no host named 'nowhere'"),
])
def test_bad_schedules_change_nothing(store, name, every, kwargs, error, needle):
    with pytest.raises(error) as info:
        jobs.schedule(store, name, every, Policy(), now=T0, **kwargs)
    assert needle in str(info.value)
    assert jobs.jobs(store) == []


def test_run_snapshots_records_and_prunes(store):
    clock = Clock(T0)
    take = Taker(clock)
    jobs.schedule(store, "desk", "*:0/15 UTC", Policy(last=2), now=T0)
    for i in range(4):
        clock.t = T0 + i * 900
        result = runner.run(store, "desk", take=take, clock=clock)
        assert result.ok, result.error
    assert [v.number for v in jobs.backups(store, "desk")] == [4, 5]      # keep-last 2
    assert store.catalogue.version("desk", 1) is not None                 # not a backup: never pruned
    job = _job(store)
    assert (job.last_result, job.last_version, job.last_bytes, job.last_pause) == ("ok", 5, 1000, 0.25)
    assert job.running_since is None and job.last_run == T0 + 3 * 900


def test_prune_dry_run_says_why_and_removes_nothing(store):
    clock = Clock(T0)
    take = Taker(clock)
    jobs.schedule(store, "desk", "daily UTC", Policy(), now=T0)
    for day in range(5):
        for hour in (1, 13):
            clock.t = T0 + day * 86400 + hour * 3600
            take(store, "desk", "memory", None)
    jobs.schedule(store, "desk", "daily UTC", Policy(last=1, daily=3), now=T0)
    result = runner.prune(store, "desk", dry_run=True, tz=UTC)
    why = {d.snapshot.number: (d.keep, d.reasons) for d in result.decisions}
    assert why[11] == (True, ["last", "daily"])
    assert why[9] == (True, ["daily"]) and why[7] == (True, ["daily"])
    assert why[10] == (False, [])
    assert len(jobs.backups(store, "desk")) == 10                          # dry run: nothing removed
    done = runner.prune(store, "desk", tz=UTC)
    assert done.removed == [2, 3, 4, 5, 6, 8, 10]
    assert [v.number for v in jobs.backups(store, "desk")] == [7, 9, 11]


def test_a_failing_run_is_recorded_and_leaves_no_version(store):
    clock = Clock(T0)
    take = Taker(clock)
    take.fail = "capsule 'desk' is not running"
    jobs.schedule(store, "desk", "*:0/15 UTC", Policy(last=2), now=T0)
    result = runner.run(store, "desk", take=take, clock=clock)
    assert not result.ok and "not running" in result.error
    job = _job(store)
    assert job.last_result == "failed" and "not running" in job.last_error and job.running_since is None
    assert jobs.backups(store, "desk") == []


# -- the scheduler with an injected clock ---------------------------------------------------------
def test_missed_runs_are_done_once_at_start(store):
    clock = Clock(T0)
    take = Taker(clock)
    jobs.schedule(store, "desk", "*:0/15 UTC", Policy(), now=T0)        # next: 10:15
    clock.t = T0 + 3 * 3600 + 60                                          # down until 13:01: 12 slots missed
    sched = Scheduler(store, clock=clock, take=take)
    assert sched.tick() == ["desk"]
    assert sched.wait_idle(10)
    assert take.calls == [clock.t]                                        # once, not 12 times
    assert _job(store).next_run == T0 + 3 * 3600 + 15 * 60                # the next slot after now
    assert sched.tick() == []                                             # nothing due until 13:15
    clock.t = T0 + 3 * 3600 + 15 * 60
    assert sched.tick() == ["desk"] and sched.wait_idle(10)
    assert len(take.calls) == 2


def test_runs_of_one_job_never_overlap(store):
    clock = Clock(T0 + 15 * 60)
    take = Taker(clock)
    take.gate = threading.Event()
    jobs.schedule(store, "desk", "*:0/15 UTC", Policy(), now=T0)
    sched = Scheduler(store, clock=clock, take=take)
    assert sched.tick() == ["desk"]
    assert take.entered.wait(10)
    clock.t += 15 * 60                                                    # the next slot, still running
    assert sched.tick() == []
    # nor from another caller (`capsule backup run` in this process)
    assert runner.run(store, "desk", take=take, clock=clock).skipped
    take.gate.set()
    assert sched.wait_idle(10)
    assert len(take.calls) == 1
    clock.t += 15 * 60
    assert sched.tick() == ["desk"] and sched.wait_idle(10)
    assert len(take.calls) == 2


def test_a_run_claimed_by_another_process_is_not_started_again(store):
    jobs.schedule(store, "desk", "*:0/15 UTC", Policy(), now=T0)
    assert jobs.claim(store, "desk", T0)                                  # as another process would
    take = Taker(Clock(T0 + 60))
    assert runner.run(store, "desk", take=take, clock=Clock(T0 + 60)).skipped and take.calls == []
    # a claim older than a run can take is not held any more
    assert not runner.run(store, "desk", take=take, clock=Clock(T0 + jobs.STALE_RUN + 1)).skipped


def test_a_claim_left_by_a_dead_process_is_not_held(store):
    jobs.schedule(store, "desk", "*:0/15 UTC", Policy(), now=T0)
    dead = 2 ** 22 + 1          # above the largest pid Linux allows: no such process
    host = socket.gethostname()
    store.catalogue.query("UPDATE backup_jobs SET running_since=?, running_by=? WHERE capsule='desk'",
                          (T0, f"{host}:{dead}"))
    take = Taker(Clock(T0 + 60))
    assert runner.run(store, "desk", take=take, clock=Clock(T0 + 60)).ok
    # one marked by a live process (this one) is held
    store.catalogue.query("UPDATE backup_jobs SET running_since=?, running_by=? WHERE capsule='desk'",
                          (T0, f"{host}:{os.getpid()}"))
    assert runner.run(store, "desk", take=take, clock=Clock(T0 + 120)).skipped


def test_a_failed_run_is_retried_at_the_next_slot(store):
    clock = Clock(T0 + 15 * 60)
    take = Taker(clock)
    take.fail = "the store's file system is full"
    jobs.schedule(store, "desk", "*:0/15 UTC", Policy(), now=T0)
    sched = Scheduler(store, clock=clock, take=take)
    assert sched.tick() == ["desk"] and sched.wait_idle(10)
    job = _job(store)
    assert job.last_result == "failed" and "file system is full" in job.last_error
    assert job.next_run == T0 + 30 * 60
    take.fail = None
    clock.t = T0 + 30 * 60
    assert sched.tick() == ["desk"] and sched.wait_idle(10)
    job = _job(store)
    assert job.last_result == "ok" and job.last_error is None and len(jobs.backups(store, "desk")) == 1


def test_the_thread_runs_due_jobs_and_stops(store):
    take = Taker(Clock(T0))
    jobs.schedule(store, "desk", "*:0/15 UTC", Policy(), now=T0)          # due long ago (real clock)
    sched = Scheduler(store, take=take, poll=0.05).start()
    try:
        deadline = time.monotonic() + 10
        while not take.calls and time.monotonic() < deadline:
            time.sleep(0.02)
        assert take.calls, "the scheduler thread never ran the due job"
    finally:
        sched.stop()
    assert sched.wait_idle(10)


# -- the CLI: bad input gets a clear error and changes nothing ------------------------------------
@pytest.mark.parametrize(("args", "needle"), [
    (["schedule", "desk", "--every", "*:61"], "minute 61"),
    (["schedule", "ghost", "--every", "daily"], "no capsule named 'ghost'"),
    (["schedule", "desk", "--every", "daily", "--with-memory", "--disk-only"], "exclude each other"),
    (["schedule", "desk", "--every", "daily", "--keep-daily", "-1"], "--keep-daily -1"),
    (["schedule", "desk", "--every", "daily", "--keep-within", "soon"], "--keep-within 'soon'"),
    (["schedule", "bad/name", "--every", "daily"], "invalid capsule name"),
    (["run", "desk"], "has no backup schedule"),
    (["prune", "desk"], "has no backup schedule"),
    (["restore", "desk"], "NAME@V"),
    (["restore", "desk@9"], "has no version 9"),
])
def test_cli_bad_input(store, args, needle):
    from capsule.cli.main import app

    r = CliRunner().invoke(app, ["--home", str(store.home), "backup", *args])
    assert r.exit_code != 0
    assert needle in str(r.exception), r.output
    assert jobs.jobs(store) == [] and len(store.catalogue.versions("desk")) == 1


def test_cli_schedule_ls_json(store):
    from capsule.cli.main import app

    home = ["--home", str(store.home)]
    r = CliRunner().invoke(app, [*home, "backup", "schedule", "desk", "--every", "mon..fri 21:00",
                                 "--keep-daily", "7", "--keep-weekly", "4", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["normalized"] == "Mon..Fri *-*-* 21:00:00"
    r = CliRunner().invoke(app, [*home, "backup", "ls", "desk", "--json"])
    (row,) = json.loads(r.stdout)
    assert row["policy"] == {"daily": 7, "weekly": 4} and row["backups"] == []
    r = CliRunner().invoke(app, [*home, "backup", "--help"])
    assert "capsule backup schedule desk --every" in r.stdout


def test_a_backup_host_that_is_down_leaves_the_copy_waiting(store):
    from tests.helpers.inprocess_agent import free_port

    store.catalogue.query(      # a known host, whose agent no longer answers
        "INSERT INTO peers VALUES('vault', ?, 'a-token-of-the-vault-0123', 'abcdef0123', 0, NULL)",
        (f"http://127.0.0.1:{free_port()}",))
    clock = Clock(T0)
    take = Taker(clock)
    job, _ = jobs.schedule(store, "desk", "hourly UTC", Policy(last=5), target="vault", now=T0)
    assert job.target == "vault"
    result = runner.run(store, "desk", take=take, clock=clock)
    assert not result.ok and result.copy.waiting == [2] and "retried at the next run" in result.error
    job = _job(store)
    assert job.last_result == "not copied" and job.last_version == 2
    assert [v.number for v in jobs.backups(store, "desk")] == [2]      # the local backup is kept


def test_cli_human_views_show_results_and_reasons(store):
    from capsule.cli.main import app

    clock = Clock(T0)
    take = Taker(clock)
    jobs.schedule(store, "desk", "daily UTC", Policy(last=1, daily=2), now=T0)
    for day in range(3):
        clock.t = T0 + day * 86400
        assert runner.run(store, "desk", take=take, clock=clock).ok
    home = ["--home", str(store.home)]
    r = CliRunner().invoke(app, [*home, "backup", "ls", "desk"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "ok" in r.stdout and "keep-last 1, keep-daily 2" in r.stdout and "desk@4" in r.stdout
    r = CliRunner().invoke(app, [*home, "backup", "prune", "desk", "--dry-run"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "last, daily" in r.stdout and "would remove 0 backup(s)" in r.stdout
    r = CliRunner().invoke(app, [*home, "backup", "unschedule", "desk"])
    assert r.exit_code == 0 and jobs.jobs(store) == []


def test_cli_schedule_to_a_repository_url(store, monkeypatch):
    """--to takes a repository URL as well as a host; a malformed one changes nothing. Without a passphrase
    in the environment the run keeps its backup and says the copy waits."""
    from capsule.cli.main import app

    home = ["--home", str(store.home)]
    bad = CliRunner().invoke(app, [*home, "backup", "schedule", "desk", "--every", "daily", "--to", "s3://h/UP"])
    assert bad.exit_code != 0 and "bucket name" in str(bad.exception) and jobs.jobs(store) == []
    url = "s3+http://127.0.0.1:9/backups/lab"
    r = CliRunner().invoke(app, [*home, "backup", "schedule", "desk", "--every", "daily", "--keep-last", "3",
                                 "--to", url, "--to-keep", "last=1", "--json"])
    assert r.exit_code == 0, r.output
    assert _job(store).target == url and _job(store).there_policy.last == 1
    monkeypatch.delenv("CAPSULE_REPO_PASSPHRASE", raising=False)
    monkeypatch.delenv("CAPSULE_REPO_KEY_FILE", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    clock = Clock(T0)
    result = runner.run(store, "desk", take=Taker(clock), clock=clock)
    assert not result.ok and result.copy.waiting == [2] and "cannot be opened" in result.error
    assert [v.number for v in jobs.backups(store, "desk")] == [2]
