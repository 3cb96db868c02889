"""What a migration reports while it runs, and how it is cancelled.

A migration goes through PHASES in order — ``balloon`` (only when asked), ``save`` (the memory image is
written here), ``memory`` (the memory image travels), ``disk`` (the disk layers, kernel and initrd travel;
not in demand mode, where the disks are paged in later), ``resume`` (the other host starts it). Each
event is a snapshot of the whole migration (:class:`Snapshot`), so a late listener needs only the last
one. Everything in it only moves forward: the phase, the bytes on the wire, the bytes the other host
found locally (in its hash cache, in a shadow from an interrupted run, or objects it already held), the
bytes accounted for. The end is one of ``done`` (it runs at the other host), ``cancelled`` or
``failed`` (it runs here again, unless the other host may have started it: see ``where``).

A live move (:mod:`capsule.migrate.live`) goes through LIVE_PHASES instead — ``precheck`` (why the other
host would refuse it), ``disks`` (the disks sealed at T0 while the guest runs, that version pushed),
``memory`` (libvirt's pre-copy rounds: the round, the bytes sent in it, the guest's dirty rate, what
remains), ``switchover`` (the guest pauses here and resumes there: the measured pause), ``postcopy`` (only
when asked, or when pre-copy does not converge: the guest runs there while its last pages follow).

A :class:`CancelToken` is checked between steps and between transfer batches. Once the start request
has gone to the other host the migration can no longer be cancelled (:meth:`CancelToken.commit`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from capsule import transfer
from capsule.errors import Cancelled

PHASES = ("balloon", "save", "memory", "disk", "resume")
LIVE_PHASES = ("precheck", "disks", "memory", "switchover", "postcopy")
OUTCOMES = ("done", "cancelled", "failed")
MIN_INTERVAL = 0.1         # seconds between two progress events within a phase (phase changes always go out)
ETA_AFTER = 0.5            # seconds of transfer before an ETA is guessed


class CancelToken:
    """Set by whoever wants the migration to stop; checked by the migration between steps and batches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._committed = False

    def cancel(self) -> bool:
        """Ask the migration to stop. False when it is too late (the other host is starting it)."""
        with self._lock:
            if self._committed:
                return False
            self._cancelled = True
            return True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def committed(self) -> bool:
        return self._committed

    def check(self) -> None:
        """Raise :class:`Cancelled` if a cancel was asked."""
        if self._cancelled:
            raise Cancelled("the migration was cancelled")

    def commit(self) -> None:
        """The point of no return: raise if a cancel came first, else refuse every later cancel."""
        with self._lock:
            self.check()
            self._committed = True


@dataclass(frozen=True)
class Snapshot:
    seq: int
    capsule: str
    to: str                         # the destination (peer name or URL)
    phases: tuple[str, ...]         # the phases this migration goes through, in order
    phase: str                      # the current one ("" before the first)
    wire_bytes: int = 0             # bytes this host put on the wire
    local_bytes: int = 0            # raw bytes the other host found itself (hash cache, shadow, present)
    done_bytes: int = 0             # raw bytes accounted for (sent or found locally)
    total_bytes: int | None = None  # raw bytes of what travels (memory + disk phases), once known
    phase_done: int = 0             # the same, for the current phase
    phase_total: int | None = None
    eta_seconds: float | None = None
    elapsed: float = 0.0
    outcome: str | None = None      # None while running, else one of OUTCOMES
    where: str | None = None        # at the end: where the capsule runs ("source", "destination", "unknown")
    version: str | None = None      # the version the suspend made
    message: str = ""
    cancellable: bool = True
    # a live move's memory rounds (None before libvirt reports one)
    round: int | None = None            # libvirt's pre-copy iteration
    round_bytes: int = 0                # bytes sent in that round so far
    dirty_rate: int | None = None       # pages the guest dirties per second
    remaining_bytes: int | None = None  # memory still to send
    disk_bytes: int = 0                 # the disks' writes since T0, sent by libvirt
    pause_ms: int | None = None         # the switchover: how long the guest was paused (libvirt's downtime)

    @property
    def index(self) -> int:
        return self.phases.index(self.phase) if self.phase else -1

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["phases"] = list(self.phases)
        d["index"] = self.index
        return d


def planned(mode: str, balloon: bool) -> tuple[str, ...]:
    if mode == "live":
        return LIVE_PHASES if balloon else LIVE_PHASES[:-1]     # (``balloon`` here: post-copy asked for)
    skip = {"balloon"} if not balloon else set()
    if mode == "demand":
        skip.add("disk")
    return tuple(p for p in PHASES if p not in skip)


@dataclass
class _Counts:
    wire: int = 0
    local: int = 0
    done: int = 0
    per_phase: dict[str, int] = field(default_factory=dict)


class Tracker(transfer.Progress):
    """Turns a migration's steps and its push's progress callbacks into :class:`Snapshot` events for
    ``listener``. Counters and the phase never go back, whatever the callbacks say."""

    def __init__(self, capsule: str, to: str, phases: tuple[str, ...],
                 listener: Callable[[Snapshot], None] = lambda _s: None, *,
                 clock: Callable[[], float] = time.monotonic, min_interval: float = MIN_INTERVAL) -> None:
        self._lock = threading.RLock()
        self._listener = listener
        self._clock = clock
        self._min_interval = min_interval
        self._t0 = clock()
        self._last_emit = float("-inf")
        self._transfer_t0: float | None = None
        self._counts = _Counts()
        self._totals: dict[str, int] = {}
        self.last = Snapshot(0, capsule, to, phases, "")

    # -- steps ---------------------------------------------------------------------------------------
    def enter(self, phase: str, message: str = "") -> None:
        """Move on to ``phase``; a phase not planned, or one already passed, is ignored."""
        with self._lock:
            if phase not in self.last.phases or self.last.phases.index(phase) <= self.last.index:
                return
            if phase in ("memory", "disk", "disks") and self._transfer_t0 is None:
                self._transfer_t0 = self._clock()
            self._emit(phase=phase, message=message or self.last.message, force=True)

    def totals(self, by_phase: dict[str, int]) -> None:
        """The raw bytes each transfer phase moves or finds (known once the version exists)."""
        with self._lock:
            self._totals = {p: n for p, n in by_phase.items() if p in self.last.phases}
            self._emit(force=True)

    def set_version(self, ref: str) -> None:
        with self._lock:
            self._emit(version=ref, force=True)

    def replan(self, phases: tuple[str, ...]) -> None:
        """The planned phases change (a live move falls back to post-copy): earlier phases stay as they were."""
        with self._lock:
            self._emit(phases=phases, force=True)

    def job(self, *, iteration: int | None, round_bytes: int, dirty_rate: int | None, remaining: int | None,
            disk_bytes: int, wire: int) -> None:
        """libvirt's job statistics during a live move's memory phase (counters only move forward)."""
        with self._lock:
            prev = self.last
            self._counts.wire = max(self._counts.wire, wire)
            changes: dict[str, Any] = {"disk_bytes": max(prev.disk_bytes, disk_bytes), "dirty_rate": dirty_rate,
                                       "remaining_bytes": remaining}
            if iteration is not None and (prev.round is None or iteration >= prev.round):
                changes["round"] = iteration
                changes["round_bytes"] = (round_bytes if iteration != prev.round
                                          else max(prev.round_bytes, round_bytes))
            self._emit(**changes)

    def note(self, message: str) -> None:
        """What happens now, within the phase (a post-copy waiting for its link)."""
        with self._lock:
            self._emit(message=message, force=True)

    def pause(self, ms: int) -> None:
        with self._lock:
            self._emit(pause_ms=ms, force=True)

    def no_return(self) -> None:
        with self._lock:
            self._emit(cancellable=False, force=True)

    def finish(self, outcome: str, where: str, message: str) -> Snapshot:
        assert outcome in OUTCOMES
        with self._lock:
            if self.last.outcome is None:
                self._emit(outcome=outcome, where=where, message=message, eta_seconds=None, cancellable=False,
                           force=True)
            return self.last

    # -- transfer.Progress -------------------------------------------------------------------------------
    def object(self, kind: str, oid: str, role: str, raw_bytes: int, present: bool) -> None:
        if "disks" in self.last.phases:     # a live move: only its T0 disks are pushed
            self.enter("disks")
        else:
            self.enter("memory" if role == "memory" else "disk")
        if present:
            self._add(raw_bytes, local=raw_bytes)

    def advance(self, n: int) -> None:
        self._add(n)

    def local(self, n: int) -> None:
        self._add(0, local=n)

    def wire(self, total_wire: int) -> None:
        with self._lock:
            self._counts.wire = max(self._counts.wire, total_wire)
            self._emit()

    @property
    def wire_bytes(self) -> int:
        return self._counts.wire

    # -- inside ----------------------------------------------------------------------------------------
    def _add(self, done: int, *, local: int = 0) -> None:
        with self._lock:
            c = self._counts
            c.done += max(0, done)
            c.local += max(0, local)
            phase = self.last.phase
            c.per_phase[phase] = c.per_phase.get(phase, 0) + max(0, done)
            self._emit()

    def _eta(self, now: float, done: int, total: int | None) -> float | None:
        if total is None or self._transfer_t0 is None or self.last.phase not in ("memory", "disk", "disks"):
            return None
        spent = now - self._transfer_t0
        if spent < ETA_AFTER or done <= 0:
            return None
        return max(0.0, (total - done) * spent / done)

    def _emit(self, *, force: bool = False, **changes: Any) -> None:
        now = self._clock()
        if not force and now - self._last_emit < self._min_interval:
            return
        phase = changes.get("phase", self.last.phase)
        total = sum(self._totals.values()) if self._totals else None
        c = self._counts
        done = c.done if total is None else min(c.done, total)
        prev = self.last
        snap = replace(prev, seq=prev.seq + 1, wire_bytes=max(prev.wire_bytes, c.wire),
                       local_bytes=max(prev.local_bytes, min(c.local, done) if total is not None else c.local),
                       done_bytes=max(prev.done_bytes, done), total_bytes=total,
                       phase_done=c.per_phase.get(phase, 0) if phase == prev.phase else 0,
                       phase_total=self._totals.get(phase), elapsed=round(now - self._t0, 3), **changes)
        if "eta_seconds" not in changes:
            snap = replace(snap, eta_seconds=self._eta(now, snap.done_bytes, total))
        if snap.phase_total is not None:
            snap = replace(snap, phase_done=min(snap.phase_done, snap.phase_total))
        self.last = snap
        self._last_emit = now
        self._listener(snap)
