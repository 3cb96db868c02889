"""Backup schedules (``capsule backup schedule/ls/unschedule``): one job per capsule, kept in the
catalogue in a table of its own with the job's state (next run, last run, result, duration, bytes,
error). A backup is a version whose note starts with ``backup``: the note is written in the same
transaction as the version, so a version is a backup from the moment it exists, or not at all."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from capsule import hosts
from capsule.backup.calendar import CalendarError, CalendarEvent, parse
from capsule.backup.retention import Policy
from capsule.capsules import resolve
from capsule.errors import Conflict, NotFound
from capsule.names import check_name
from capsule.repo import backups as repo_backups
from capsule.store import Store
from capsule.store.catalogue import VersionRow

MODES = ("memory", "disk-only")
NOTE_PREFIX = "backup"
STALE_RUN = 6 * 3600.0      # a run marked running longer than this died with its process


def backup_note(mode: str, consistency: str) -> str:
    return f"{NOTE_PREFIX} ({mode}, {consistency})"


def is_backup(version: VersionRow) -> bool:
    return version.note == NOTE_PREFIX or version.note.startswith(f"{NOTE_PREFIX} (")


@dataclass
class Job:
    capsule: str
    calendar: str
    policy: Policy
    mode: str
    target: str | None
    created: float
    next_run: float | None = None
    running_since: float | None = None
    running_by: str | None = None       # HOST:PID of the process running it
    last_run: float | None = None
    last_result: str | None = None      # ok | failed | not copied
    last_duration: float | None = None
    last_bytes: int | None = None
    last_pause: float | None = None
    last_version: int | None = None
    last_error: str | None = None
    target_policy: Policy | None = None  # the backup host's own policy (None: the same as here)

    @property
    def there_policy(self) -> Policy:
        """The policy the backup host applies to its copies."""
        return self.target_policy or self.policy

    @property
    def event(self) -> CalendarEvent:
        return parse(self.calendar)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["policy"] = self.policy.as_dict()
        d["policy_text"] = self.policy.describe()
        d["target_policy"] = self.target_policy.as_dict() if self.target_policy else None
        d["target_policy_text"] = self.there_policy.describe() if self.target else None
        d["normalized"] = self.event.normalized()
        return d


def _job(row: Any) -> Job:
    d = dict(row)
    d["policy"] = Policy.from_dict(json.loads(d["policy"]))
    d["target_policy"] = Policy.from_dict(json.loads(d["target_policy"])) if d.get("target_policy") else None
    return Job(**d)


def jobs(store: Store) -> list[Job]:
    return [_job(r) for r in store.catalogue.query("SELECT * FROM backup_jobs ORDER BY capsule")]


def find(store: Store, name: str) -> Job | None:
    rows = store.catalogue.query("SELECT * FROM backup_jobs WHERE capsule=?", (name,))
    return _job(rows[0]) if rows else None


def get(store: Store, name: str) -> Job:
    check_name(name)
    job = find(store, name)
    if job is None:
        raise NotFound(f"capsule {name!r} has no backup schedule (see `capsule backup ls`; "
                       f"`capsule backup schedule {name} --every daily --keep-daily 7`)")
    return job


def schedule(store: Store, name: str, every: str, policy: Policy, *, mode: str = "memory",
             target: str | None = None, target_policy: Policy | None = None, now: float | None = None
             ) -> tuple[Job, bool]:
    """Create or change the backup schedule of ``name``; returns (job, created). Everything is checked
    before anything is written: the capsule, the calendar (it must elapse again), the mode, the target."""
    check_name(name)
    resolve(store, name)
    if mode not in MODES:
        raise Conflict(f"unknown backup mode {mode!r}: give --memory or --disk-only")
    event = parse(every)
    now = time.time() if now is None else now
    next_run = event.next_after(now)
    if next_run is None:
        raise CalendarError(f"{every!r} ({event.normalized()}) never elapses after now: nothing would run")
    if target is not None and repo_backups.is_repository(target):
        target = repo_backups.check_target(target)
    elif target is not None:
        hosts.get(store, check_name(target, "host"))
    elif target_policy is not None:
        raise Conflict("a backup host's policy (--to-keep) needs a backup host: give --to HOST")
    there = json.dumps(target_policy.as_dict()) if target_policy is not None else None
    cat = store.catalogue
    with cat.transaction():
        old = find(store, name)
        if old is None:
            cat.query("INSERT INTO backup_jobs(capsule, calendar, policy, mode, target, created, next_run, "
                      "target_policy) VALUES(?,?,?,?,?,?,?,?)",
                      (name, every, json.dumps(policy.as_dict()), mode, target, now, next_run.timestamp(), there))
        else:
            cat.query("UPDATE backup_jobs SET calendar=?, policy=?, mode=?, target=?, next_run=?, target_policy=? "
                      "WHERE capsule=?", (every, json.dumps(policy.as_dict()), mode, target, next_run.timestamp(),
                                          there, name))
    return get(store, name), old is None


def unschedule(store: Store, name: str) -> Job:
    """Drop the schedule; the backups already made stay (prune or `capsule rm NAME@V` removes them)."""
    job = get(store, name)
    store.catalogue.query("DELETE FROM backup_jobs WHERE capsule=?", (name,))
    return job


def backups(store: Store, name: str) -> list[VersionRow]:
    """The backup versions of ``name`` that exist, oldest first."""
    return [v for v in store.catalogue.versions(name) if is_backup(v)]


# -- run state ---------------------------------------------------------------------------------------
def _me() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(running_by: str | None) -> bool:
    """Whether the process that marked a run is still there (one on another host is taken to be)."""
    host, _, pid = (running_by or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(store: Store, name: str, now: float) -> bool:
    """Mark the job running unless a run is already going (in any process); False if one is. A mark left
    by a process that died (on this host), or older than STALE_RUN, does not count."""
    cat = store.catalogue
    with cat.transaction():
        rows = cat.query("SELECT running_since, running_by FROM backup_jobs WHERE capsule=?", (name,))
        if rows and rows[0]["running_since"] is not None and now - rows[0]["running_since"] < STALE_RUN \
                and _alive(rows[0]["running_by"]):
            return False
        if rows:
            cat.query("UPDATE backup_jobs SET running_since=?, running_by=? WHERE capsule=?", (now, _me(), name))
    return True


def advance(store: Store, name: str, next_run: float | None) -> None:
    store.catalogue.query("UPDATE backup_jobs SET next_run=? WHERE capsule=?", (next_run, name))


def finish(store: Store, name: str, *, started: float, ok: bool, duration: float, version: int | None = None,
           nbytes: int | None = None, pause: float | None = None, error: str | None = None,
           result: str | None = None) -> None:
    """Record a run's outcome (the job may have been unscheduled meanwhile: then nothing is recorded).
    ``result`` (default ok/failed) may say more, e.g. 'not copied' when the backup host was down."""
    store.catalogue.query(
        "UPDATE backup_jobs SET running_since=NULL, running_by=NULL, last_run=?, last_result=?, last_duration=?, "
        "last_bytes=?, last_pause=?, last_version=?, last_error=? WHERE capsule=?",
        (started, result or ("ok" if ok else "failed"), duration, nbytes, pause, version, error, name))
