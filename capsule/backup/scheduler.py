"""The backup scheduler: a thread inside ``capsule serve`` (no cron, no other daemon).

Each job has its next run in the catalogue. When it is due the scheduler first moves it to the
calendar's next slot after *now*, then runs it in a worker thread. So:

- runs missed while the agent was down are done once at start, not once per missed slot (like systemd's
  ``Persistent=true``);
- two runs of one job never overlap: a slot that comes while the previous run still goes is skipped;
- a failed run is recorded with its reason (``runner.run``) and the job simply runs at its next slot.

The host's backup verify job (``verifyjob``) is scheduled the same way.

The clock is injectable (``clock``: epoch seconds) and ``tick(now)`` does one round, for tests."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from capsule.backup import jobs, runner, verifyjob
from capsule.backup.calendar import CalendarError
from capsule.store import Store

log = logging.getLogger("capsule.backup")
VERIFY = "verify backups"     # the verify job's worker (no capsule name can hold a space)
POLL = 30.0          # seconds between looks at the table when nothing is due sooner (new jobs appear)


class Scheduler:
    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time,
                 take: runner.Taker = runner.take_snapshot, poll: float = POLL) -> None:
        self.store = store
        self.clock = clock
        self.take = take
        self.poll = poll
        self.results: list[runner.RunResult] = []      # the last runs, newest last (kept short)
        self._workers: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one round ---------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[str]:
        """Start every due job whose previous run is over; returns the names started."""
        now = self.clock() if now is None else now
        started = []
        for job in jobs.jobs(self.store):
            if job.next_run is None or job.next_run > now:
                continue
            try:
                nxt = job.event.next_after(now)
            except CalendarError as exc:      # a row edited by hand: stop it, say why
                jobs.advance(self.store, job.capsule, None)
                jobs.finish(self.store, job.capsule, started=now, ok=False, duration=0.0, error=str(exc))
                continue
            jobs.advance(self.store, job.capsule, nxt.timestamp() if nxt else None)
            if self._spawn(job.capsule, functools.partial(self._run, job.capsule)):
                started.append(job.capsule)
        if verifyjob.due(self.store, now) and self._spawn(VERIFY, self._verify):
            started.append(VERIFY)
        return started

    def _spawn(self, key: str, target: Callable[[], None]) -> bool:
        with self._lock:
            if key in self._workers and self._workers[key].is_alive():
                log.info("%s: slot skipped, the previous run is still going", key)
                return False
            worker = threading.Thread(target=target, daemon=True, name=key)
            self._workers[key] = worker
        worker.start()
        return True

    def _verify(self) -> None:
        try:
            result = verifyjob.run_job(self.store, clock=self.clock)
        except Exception as exc:  # noqa: BLE001 - the thread must survive anything
            log.warning("backup verify failed: %s", exc)
            return
        if result is not None and not result.ok:
            log.warning("backup verify: %s", result.summary())

    def _run(self, name: str) -> None:
        try:
            result = runner.run(self.store, name, take=self.take, clock=self.clock)
        except Exception as exc:  # noqa: BLE001 - the thread must survive anything (e.g. job unscheduled)
            log.warning("backup of %s failed: %s", name, exc)
            return
        if not result.ok:
            log.warning("backup of %s failed: %s", name, result.error)
        with self._lock:
            self.results = [*self.results[-99:], result]

    def wait_idle(self, timeout: float) -> bool:
        """Wait for the running jobs to finish (tests); False if some still run after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
        return not any(w.is_alive() for w in workers)

    # -- the thread ----------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="backup scheduler")
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                wait = self._until_next()
            except Exception as exc:  # noqa: BLE001 - keep scheduling whatever one round ran into
                log.warning("backup scheduler: %s", exc)
                wait = self.poll
            self._stop.wait(wait)

    def _until_next(self) -> float:
        due = [j.next_run for j in jobs.jobs(self.store) if j.next_run is not None]
        if (v := verifyjob.get(self.store)) is not None and v.next_run is not None:
            due.append(v.next_run)
        if not due:
            return self.poll
        return min(self.poll, max(0.5, min(due) - self.clock()))


def start_in_serve(home: Path) -> Scheduler:
    """The scheduler of ``capsule serve``: its own store handle, a daemon thread."""
    return Scheduler(Store.open(home)).start()
