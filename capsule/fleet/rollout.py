"""Running a planned rollout: stage after stage, each host's transfer from a sender chosen by
``fanout.Sources``, an event for every change of a host's state, and the stop at the failure threshold.

The rules:

- a host that did not answer before the rollout is ``offline``: skipped, not a failure (the next run
  sends it what it lacks); a host that already holds the version is ``already`` (nothing is sent);
- a failed transfer (or activation) is a failure; the rollout tolerates ``max_failures`` of them in all.
  When one more is known, no further host is started — hosts already sending finish — and the rollout
  stops, naming the stage and the host. With one transfer at a time (``--parallel 1`` without fan-out)
  it stops after exactly ``max_failures + 1`` failures;
- a stage starts only when the stages before it ended within the threshold.

Pure of I/O: the transfer and activation are callables (``hostops`` has the real ones)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any

from capsule.fleet.fanout import ORIGIN, REPOSITORY, Sources
from capsule.fleet.plan import Plan

# (host, source: ORIGIN, REPOSITORY or a host, on_bytes(total wire bytes so far)) → wire bytes of the transfer
Transfer = Callable[[str, str, Callable[[int], None]], int]
Activate = Callable[[str], str]   # host → what it did ("started NAME@V", "already running", …)
MAX_WORKERS = 64
STATES = ("waiting", "offline", "sending", "activating", "done", "already", "failed", "not started", "held back")


@dataclass
class HostResult:
    host: str
    stage: str
    state: str = "waiting"
    source: str | None = None     # None: nothing sent; "origin", "repository" or the host it pulled from
    bytes: int = 0
    reason: str | None = None
    activation: str | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Outcome:
    results: list[HostResult]
    failures: int
    stopped: str | None          # where and why it stopped; None if every stage ran

    @property
    def completed(self) -> bool:
        return self.stopped is None

    def as_dict(self) -> dict[str, Any]:
        return {"completed": self.completed, "stopped": self.stopped, "failures": self.failures,
                "hosts": [r.as_dict() for r in self.results]}


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class Rollout:
    def __init__(self, plan: Plan, *, transfer: Transfer, activate: Activate | None = None,
                 offline: dict[str, str] | None = None, already: set[str] | frozenset[str] = frozenset(),
                 holders: list[str] | None = None, parallel: int = 4, fanout: bool = True,
                 max_failures: int = 0, on_event: Callable[[HostResult], None] = lambda _r: None,
                 last_resort: str = ORIGIN) -> None:
        if max_failures < 0:
            raise ValueError("max_failures must be 0 or more")
        self.plan = plan
        self.transfer = transfer
        self.activate = activate
        self.offline = offline or {}
        self.already = set(already)
        self.sources = Sources(parallel, holders if holders is not None else sorted(self.already), fanout=fanout,
                               last_resort=last_resort)
        self.max_failures = max_failures
        self.on_event = on_event
        self.failures = 0
        self._lock = threading.Lock()
        self.results = {h: HostResult(h, s.name) for s in plan.stages for h in s.hosts}
        for h in plan.held_back:
            self.results[h] = HostResult(h, "-", "held back")

    def _set(self, r: HostResult, **changes: Any) -> None:
        with self._lock:
            for k, v in changes.items():
                setattr(r, k, v)
        self.on_event(r)

    def _activate(self, r: HostResult) -> None:
        if self.activate is not None:
            self._set(r, state="activating")
            self._set(r, activation=self.activate(r.host))

    def _one(self, r: HostResult, source: str) -> None:
        t0 = time.monotonic()
        label = {ORIGIN: "origin", REPOSITORY: "repository"}.get(source, source)
        self._set(r, state="sending", source=label)
        try:
            wire = self.transfer(r.host, source, lambda n: self._set(r, bytes=n))
            self._set(r, bytes=wire)
            self._activate(r)
        except Exception as exc:  # noqa: BLE001 - one host's failure is its result, never the rollout's crash
            self._set(r, state="failed", reason=_reason(exc), seconds=time.monotonic() - t0)
            raise
        self._set(r, state="done", seconds=time.monotonic() - t0)

    def _over(self) -> bool:
        return self.failures > self.max_failures

    def run(self) -> Outcome:
        for r in self.results.values():
            self.on_event(r)
        stopped = None
        with ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="capsule-rollout") as pool:
            for i, stage in enumerate(self.plan.stages):
                last_failed = self._stage(pool, [self.results[h] for h in stage.hosts])
                if self._over():
                    stopped = (f"stopped in {stage.name} at host {last_failed}: {self.failures} hosts failed, "
                               f"more than --max-failures {self.max_failures}")
                    for later in self.plan.stages[i:]:
                        for h in later.hosts:
                            if self.results[h].state == "waiting":
                                self._set(self.results[h], state="not started")
                    break
        return Outcome(list(self.results.values()), self.failures, stopped)

    def _stage(self, pool: ThreadPoolExecutor, stage: list[HostResult]) -> str | None:
        """Run one stage; the name of the host whose failure went over the threshold, if any."""
        queue: list[HostResult] = []
        for r in stage:
            if r.host in self.offline:
                self._set(r, state="offline", reason=self.offline[r.host])
            elif r.host in self.already:
                try:
                    self._activate(r)
                    self._set(r, state="already")
                except Exception as exc:  # noqa: BLE001
                    self.failures += 1
                    self._set(r, state="failed", reason=_reason(exc))
                    if self._over():
                        return r.host
            else:
                queue.append(r)
        running: dict[Future[None], tuple[HostResult, str]] = {}
        over_at = None
        while running or (queue and over_at is None):
            while queue and over_at is None and (src := self.sources.take()) is not None:
                r = queue.pop(0)
                running[pool.submit(self._one, r, src)] = (r, src)
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                r, src = running.pop(fut)
                self.sources.release(src)
                if fut.exception() is None:
                    self.sources.add(r.host)
                else:
                    self.failures += 1
                    if self._over() and over_at is None:
                        over_at = r.host
        return over_at
