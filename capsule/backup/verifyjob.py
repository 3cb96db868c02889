"""Backup verify jobs (``capsule backup verify [--every CALENDAR]``): re-hash everything the backups
(of every capsule, scheduled or not any more) reference — here, and on every backup host their copies
went to, through that host's agent
(``POST /v1/verify``) — and name the first broken object and the backups that use it.

One job per host, optionally on a calendar: the scheduler in ``capsule serve`` runs it like a backup job
(a missed run once at start, never two at once). Its last result is kept in the catalogue."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from capsule import hosts
from capsule.agentclient import AgentClient
from capsule.backup import copies, jobs
from capsule.backup.calendar import CalendarError, parse
from capsule.capsules import resolve
from capsule.errors import Error, NotFound
from capsule.repo import backups as repo_backups
from capsule.store import Store
from capsule.verify import Problem, VerifyReport, users_of, verify_versions

HERE = "here"
_running = threading.Lock()


@dataclass
class Broken:
    host: str               # "here" or the backup host's name
    kind: str               # layer, memory, kernel, initrd
    id: str
    error: str
    backups: list[str]      # the backups (NAME@V) that reference it


@dataclass
class HostCheck:
    host: str
    backups: list[str]
    checked_layers: int = 0
    checked_files: int = 0
    broken: list[Broken] = field(default_factory=list)
    error: str | None = None          # the host could not be asked (down, refused)


@dataclass
class VerifyResult:
    hosts: list[HostCheck]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(not h.broken and h.error is None for h in self.hosts)

    @property
    def first_broken(self) -> Broken | None:
        return next((b for h in self.hosts for b in h.broken), None)

    def summary(self) -> str:
        if (b := self.first_broken) is not None:
            where = "" if b.host == HERE else f" on {b.host}"
            used = f" (used by {', '.join(b.backups)})" if b.backups else ""
            return f"{b.kind} {b.id[:16]}{where} is broken{used}: {b.error}"
        if down := [h for h in self.hosts if h.error]:
            return "; ".join(f"{h.host} not checked: {h.error}" for h in down)
        n = sum(len(h.backups) for h in self.hosts)
        return f"all good: {n} backup(s) on {len(self.hosts)} host(s)"

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "seconds": self.seconds, "summary": self.summary(),
                "first_broken": asdict(b) if (b := self.first_broken) else None,
                "hosts": [asdict(h) for h in self.hosts]}


@dataclass
class VerifyJob:
    calendar: str
    next_run: float | None
    last_run: float | None
    last_result: str | None       # ok | broken | not checked
    last_error: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _host_check(host: str, refs: list[str], report: VerifyReport, users: dict[str, list[str]]) -> HostCheck:
    return HostCheck(host, refs, report.checked_layers, report.checked_files,
                     [Broken(host, p.kind, p.id, p.error, users.get(p.id, [])) for p in report.problems])


def run(store: Store, names: list[str] | None = None, *, remote: bool = True,
        say: Callable[[str], None] = lambda _m: None) -> VerifyResult:
    """Verify the backups of ``names`` (default: every capsule that has backups, scheduled or not) here
    and, with ``remote``, on every backup host that holds copies of them. A host that cannot be asked is
    reported, not skipped."""
    t0 = time.monotonic()
    for name in names or ():
        resolve(store, name)
    chosen = names or [c.name for c in store.catalogue.capsules()]
    refs = [v.ref for name in chosen for v in jobs.backups(store, name)]
    users = users_of(store, refs)
    say(f"re-hashing {len(refs)} backup(s) here")
    checks = [_host_check(HERE, refs, verify_versions(store, refs, say), users)]
    there: dict[str, list[str]] = {}
    for name in chosen if remote else ():
        for target, numbers in copies.copied_to(store, name).items():
            there.setdefault(target, []).extend(f"{name}@{n}" for n in sorted(numbers))
    for target, their_refs in sorted(there.items()):
        say(f"asking {target} to re-hash {len(their_refs)} backup copies")
        try:
            if repo_backups.is_repository(target):
                found = repo_backups.verify_copies(target, their_refs)
                checks.append(HostCheck(target, their_refs, broken=[
                    Broken(target, b["kind"], b["id"], b["error"], b["backups"]) for b in found["broken"]],
                    error="; ".join(found["errors"]) or None))
                continue
            peer = hosts.get(store, target)
            with AgentClient(peer.url, peer.token, timeout=3600.0, fingerprint=peer.fingerprint) as client:
                answer = client.post_json("/v1/verify", {"versions": their_refs})
            report = VerifyReport(answer["checked_layers"], answer["checked_files"])
            report.problems = [_problem(p) for p in answer["problems"]]
            # which of the copies there use a broken object: the backup host says (it may keep copies
            # that were pruned here long ago)
            there = {str(k): [str(r) for r in v] for k, v in dict(answer.get("used_by") or {}).items()}
            checks.append(_host_check(target, their_refs, report, there))
        except (Error, KeyError, TypeError, ValueError, AttributeError) as exc:
            checks.append(HostCheck(target, their_refs, error=str(exc) or type(exc).__name__))
    return VerifyResult(checks, time.monotonic() - t0)


def _problem(p: dict[str, Any]) -> Problem:
    return Problem(str(p["kind"]), str(p["id"]), str(p["error"]))


# -- the job ------------------------------------------------------------------------------------------


def get(store: Store) -> VerifyJob | None:
    rows = store.catalogue.query("SELECT calendar, next_run, last_run, last_result, last_error FROM backup_verify")
    return VerifyJob(**dict(rows[0])) if rows else None


def schedule(store: Store, calendar: str, now: float | None = None) -> VerifyJob:
    """Verify on ``calendar`` (systemd calendar event); replaces an earlier schedule."""
    event = parse(calendar)
    nxt = event.next_after(time.time() if now is None else now)
    if nxt is None:
        raise CalendarError(f"{calendar!r} ({event.normalized()}) never elapses after now: nothing would run")
    store.catalogue.query("INSERT INTO backup_verify(id, calendar, next_run) VALUES(1, ?, ?) "
                        "ON CONFLICT(id) DO UPDATE SET calendar=excluded.calendar, next_run=excluded.next_run",
                        (calendar, nxt.timestamp()))
    job = get(store)
    assert job is not None
    return job


def unschedule(store: Store) -> VerifyJob:
    job = get(store)
    if job is None:
        raise NotFound("no verify job is scheduled (see `capsule backup verify --every`)")
    store.catalogue.query("DELETE FROM backup_verify")
    return job


def due(store: Store, now: float) -> bool:
    """True once per due slot: the job is moved to its next slot after ``now`` first (like backup jobs)."""
    job = get(store)
    if job is None or job.next_run is None or job.next_run > now:
        return False
    nxt = parse(job.calendar).next_after(now)
    store.catalogue.query("UPDATE backup_verify SET next_run=?", (nxt.timestamp() if nxt else None,))
    return True


def run_job(store: Store, *, clock: Callable[[], float] = time.time) -> VerifyResult | None:
    """One run of the job, its result recorded (if the job exists); None if a run is already going in this
    process."""
    if not _running.acquire(blocking=False):
        return None
    try:
        started = clock()
        result = run(store)
        verdict = "ok" if result.ok else ("broken" if result.first_broken else "not checked")
        store.catalogue.query("UPDATE backup_verify SET last_run=?, last_result=?, last_error=?",
                            (started, verdict, None if result.ok else result.summary()))
        return result
    finally:
        _running.release()
