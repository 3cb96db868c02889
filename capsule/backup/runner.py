"""One backup run (snapshot, then prune, then copies to the backup host), pruning, and restoring a backup.

A ``--memory`` backup is ``lifecycle.snapshot``: the guest is saved (it pauses), its memory image and
disk leaves are sealed into a new version (noted as a backup in the same transaction) and it resumes on
fresh leaves. If anything fails the guest keeps running and no version is recorded (see
``lifecycle.suspend``), so a failed run never leaves a half-made backup; the failure is recorded on the
job with its reason and the next slot tries again.

Pruning drops the backup versions the policy does not keep and then collects only what nothing else
references (``hierarchy.gc``): layers shared with other versions or capsules stay. It never folds layers
into each other (``capsule rm --promote`` does): that would rename layers the remaining backups and their
off-host copies share."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import tzinfo
from typing import Any

from capsule import capsules, hierarchy, lifecycle
from capsule.backup import copies, diskonly, jobs
from capsule.backup.retention import Decision, Policy, Snapshot, apply
from capsule.errors import Conflict, Error
from capsule.names import check_name, parse_ref
from capsule.store import Store
from capsule.store.catalogue import VersionRow

Say = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


@dataclass
class Taken:
    """What a snapshot produced: the version, the bytes newly stored, the pause the guest felt."""

    version: VersionRow
    nbytes: int
    pause: float
    consistency: str          # "memory" (saved with its memory), "frozen" or "crash-consistent" (disk-only)


@dataclass
class PruneResult:
    capsule: str
    decisions: list[Decision]
    removed: list[int] = field(default_factory=list)
    freed_bytes: int = 0
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"capsule": self.capsule, "dry_run": self.dry_run, "removed": self.removed,
                "freed_bytes": self.freed_bytes, "snapshots": [d.as_dict() for d in self.decisions]}


@dataclass
class RunResult:
    capsule: str
    ok: bool
    started: float
    seconds: float
    version: int | None = None
    nbytes: int | None = None
    pause: float | None = None
    error: str | None = None
    skipped: bool = False            # another run of the job was still going
    pruned: PruneResult | None = None
    copy: copies.CopyResult | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("pruned", "copy")}
        d["pruned"] = self.pruned.as_dict() if self.pruned else None
        d["copy"] = self.copy.as_dict() if self.copy else None
        return d


def take_snapshot(store: Store, name: str, mode: str, say: Say = _quiet) -> Taken:
    """The snapshot itself. ``memory``: the guest pauses from the save until it runs again.
    ``disk-only``: see ``diskonly``; the pause is the time its file systems were frozen."""
    if mode == "disk-only":
        say("freezing, switching the disks to new leaves, thawing")
        snap = diskonly.snapshot(store, name, note=lambda consistency: jobs.backup_note(mode, consistency))
        return Taken(snap.version, sum(r.stored_bytes for r in snap.layers), snap.pause, snap.consistency)
    t0 = time.monotonic()
    sealed, _resumed = lifecycle.snapshot(store, name, note=jobs.backup_note(mode, "memory"), say=say)
    pause = time.monotonic() - t0
    assert sealed.version is not None
    nbytes = sum(layer.stored_bytes for layer in sealed.layers) + (sealed.memory.stored_bytes if sealed.memory else 0)
    return Taken(sealed.version, nbytes, pause, "memory")


Taker = Callable[[Store, str, str, Say], Taken]
_running: dict[tuple[str, str], threading.Lock] = {}
_running_guard = threading.Lock()


def _job_lock(store: Store, name: str) -> threading.Lock:
    with _running_guard:
        return _running.setdefault((str(store.home), name), threading.Lock())


def run(store: Store, name: str, *, take: Taker = take_snapshot, clock: Callable[[], float] = time.time,
        say: Say = _quiet) -> RunResult:
    """Run the job of ``name`` now: snapshot, then prune. Never two at once for one job (in this process
    or another); the outcome is recorded on the job, a failure with its reason."""
    job = jobs.get(store, name)
    started = clock()
    lock = _job_lock(store, name)
    if not lock.acquire(blocking=False):
        return RunResult(name, False, started, 0.0, error="the previous run is still going", skipped=True)
    try:
        if not jobs.claim(store, name, started):
            return RunResult(name, False, started, 0.0, error="the previous run is still going", skipped=True)
        t0 = time.monotonic()
        error: str | None
        try:
            taken = take(store, name, job.mode, say)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded on the job, with its reason
            error = str(exc) if isinstance(exc, Error) else f"{type(exc).__name__}: {exc}"
            seconds = time.monotonic() - t0
            jobs.finish(store, name, started=started, ok=False, duration=seconds, error=error)
            return RunResult(name, False, started, seconds, error=error)
        pruned = error = copy = status = None
        try:
            pruned = prune(store, name)
        except Error as exc:
            error = f"snapshot {taken.version.ref} made; pruning failed: {exc}"
        if job.target is not None:
            say(f"copying to {job.target}")
            copy = copies.push_pending(store, name, job.target)
            if copy.error:
                error, status = (f"{error}; {copy.error}" if error else copy.error), "not copied"
            else:
                try:
                    copy.pruned = copies.prune_there(store, name, job.target, job.there_policy)
                except Error as exc:
                    error = f"{error + '; ' if error else ''}pruning the copies on {job.target} failed: {exc}"
        seconds = time.monotonic() - t0
        jobs.finish(store, name, started=started, ok=error is None, duration=seconds, version=taken.version.number,
                    nbytes=taken.nbytes, pause=taken.pause, error=error, result=status)
        return RunResult(name, error is None, started, seconds, taken.version.number, taken.nbytes, taken.pause,
                         error, pruned=pruned, copy=copy)
    finally:
        lock.release()


def prune(store: Store, name: str, *, policy: Policy | None = None, dry_run: bool = False,
          tz: tzinfo | None = None) -> PruneResult:
    """Apply the job's policy (or ``policy``: a backup host's copies have no job there) to the capsule's
    backups. Never removed: the capsule's latest version and the version its running instance stands on
    (kept with the reason 'latest version' / 'running')."""
    if policy is None:
        policy = jobs.get(store, name).policy
    else:
        capsules.resolve(store, check_name(name))
    with store.lock(purpose=f"backup prune {name}"):
        cat = store.catalogue
        versions = jobs.backups(store, name)
        decisions = apply([Snapshot(v.number, v.created) for v in versions], policy, tz)
        inst = cat.instance(name)
        latest = cat.latest_version(name)
        for d in decisions:
            if d.keep:
                continue
            if latest is not None and d.snapshot.number == latest.number:
                d.keep, d.reasons = True, ["latest version"]
            elif inst is not None and d.snapshot.number == inst.version:
                d.keep, d.reasons = True, ["running"]
        doomed = sorted(d.snapshot.number for d in decisions if not d.keep)
        result = PruneResult(name, decisions, doomed, 0, dry_run)
        if dry_run or not doomed:
            return result
        with cat.transaction():
            for number in doomed:
                cat.delete_version(name, number)
        result.freed_bytes = hierarchy.gc(store).freed_bytes
        return result


@dataclass
class Restored:
    source: str
    capsule: str
    version: VersionRow
    start: lifecycle.StartResult | None

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "capsule": self.capsule, "version": self.version.ref,
                "mode": self.start.mode if self.start else None,
                "seconds": self.start.seconds if self.start else None}


def restore(store: Store, ref: str, *, as_name: str | None = None, start: bool = True, prefetch: bool = False,
            say: Say = _quiet) -> Restored:
    """Start backup ``NAME@V`` as a new capsule (``as_name``: derive, then start) or as the new latest
    version of the same capsule (which must not be running: stop or suspend it first). ``prefetch``: layers
    that are remote (a backup started straight from a repository) are pulled whole in the background."""
    r = parse_ref(ref)
    if r.version is None:
        raise Conflict(f"give the backup to restore as NAME@V (see `capsule backup ls {r.name}` or "
                       f"`capsule versions {r.name}`)")
    source = capsules.resolve(store, ref)
    if as_name is not None:
        version = capsules.derive(store, ref, as_name)
        name = as_name
    else:
        name = r.name
        with store.lock(purpose=f"backup restore {ref}"):
            cat = store.catalogue
            if cat.instance(name) is not None:
                raise Conflict(f"capsule {name!r} is running: stop or suspend it first, or restore as a new "
                               f"capsule with --as NEW")
            with cat.transaction():
                version = VersionRow(capsule=name, number=cat.next_version_number(name), parent_capsule=name,
                                     parent_version=source.number, memory=source.memory,
                                     chains=[list(c) for c in source.chains], config=dict(source.config),
                                     note=f"restored from {ref}", created=time.time())
                cat.add_version(version)
    started = lifecycle.start(store, version.ref, prefetch=prefetch, say=say) if start else None
    return Restored(ref, name, version, started)
