"""The agent's audit writer: every change one line (``capsule.audit``), but a refusal repeated is counted, not
written again, so a flood of refused calls cannot fill the disk line by line.

A refusal (any result but ``ok``) is written when it first comes; the same refusal again — same who, action,
capsule, client address and result — within ``window`` seconds of that line is only counted. When the window
closes (a timer, or the next call after it), or before a successful change is written, or when the agent stops,
one summary line is written for the ones counted: ``repeated`` (how many), ``first`` and ``last`` (when). A
continuous flood from one address so leaves two lines per window; successful changes are always written one by
one. At most ``max_open`` refusals are followed at once (the oldest is summarised and dropped first)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsule import audit
from hashcache.errors import PeerError, error_class

WINDOW = 300.0
MAX_OPEN = 4096
Key = tuple[str, str, str | None, str | None, str]      # who, action, capsule, from, result


@dataclass
class _Repeats:
    until: float             # the window closes
    count: int = 0
    first: float = 0.0
    last: float = 0.0


class AuditLog:
    """One agent's audit writer (see the module's text). ``clock`` is replaceable (tests); ``timers``: write the
    summaries when their window closes even if no other call comes (off in tests that drive the clock)."""

    def __init__(self, home: Path, rotation: audit.Rotation | None = None, *, window: float = WINDOW,
                 max_open: int = MAX_OPEN, clock: Callable[[], float] = time.time, timers: bool = True) -> None:
        self.home, self.window, self.max_open, self.clock, self.timers = Path(home), window, max_open, clock, timers
        self.rotation = rotation or audit.Rotation.from_env()
        self._open: OrderedDict[Key, _Repeats] = OrderedDict()      # oldest window first
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._timer_at = 0.0

    def record(self, *, who: str, action: str, capsule: str | None = None, remote: str | None = None,
               result: str = "ok") -> None:
        """Write (or count) one call's line. Writing failures raise, as :func:`capsule.audit.record`'s."""
        now = self.clock()
        with self._lock:
            out = self._due(now, everything=result == "ok")
            if result == "ok":
                out.append(audit.line(who=who, action=action, capsule=capsule, remote=remote, now=now))
            else:
                key: Key = (who, action, capsule, remote, result)
                seen = self._open.get(key)
                if seen is not None:
                    if seen.count == 0:
                        seen.first = now
                    seen.count += 1
                    seen.last = now
                    self._arm(seen.until)
                else:
                    self._open[key] = _Repeats(now + self.window)
                    out.append(audit.line(who=who, action=action, capsule=capsule, remote=remote, result=result,
                                          now=now))
                    while len(self._open) > self.max_open:
                        out.extend(self._summary(*self._open.popitem(last=False)))
            audit.append(self.home, out, self.rotation)

    def flush(self, *, everything: bool = False) -> None:
        """Write the summaries whose window has closed (``everything``: all of them, e.g. when the agent stops)."""
        with self._lock:
            audit.append(self.home, self._due(self.clock(), everything=everything), self.rotation)

    def close(self) -> None:
        self.flush(everything=True)
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _due(self, now: float, *, everything: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while self._open:
            key, seen = next(iter(self._open.items()))
            if not everything and seen.until > now:
                break
            del self._open[key]
            out.extend(self._summary(key, seen))
        return out

    @staticmethod
    def _summary(key: Key, seen: _Repeats) -> list[dict[str, Any]]:
        if seen.count == 0:
            return []
        who, action, capsule, remote, result = key
        return [audit.line(who=who, action=action, capsule=capsule, remote=remote, result=result, now=seen.last,
                           repeated=seen.count, first=round(seen.first, 3), last=round(seen.last, 3))]

    def _arm(self, until: float) -> None:
        """A timer for the earliest window with something counted (the caller holds the lock)."""
        if not self.timers or (self._timer is not None and self._timer_at <= until):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = until
        self._timer = threading.Timer(max(0.0, until - self.clock()) + 0.05, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self._timer = None
            out = self._due(self.clock(), everything=False)
            later = [s.until for s in self._open.values() if s.count]
            if later:
                self._arm(min(later))
            with contextlib.suppress(OSError):    # (a timer has no one to tell: the next call's write reports it)
                audit.append(self.home, out, self.rotation)


def relayed_capsule(params: dict[str, Any]) -> str | None:
    """The capsule of a relayed console call (``HOST/NAME``: its path has both), which no rule names as its capsule."""
    if "host" in params and "name" in params:
        return f"{params['host']}/{params['name']}"[:audit.MAX_FIELD]
    return None


def handshake_refusal(status: int) -> str:
    """A console handshake's refusal (a plain-text answer) as the error code its status stands for."""
    cls = error_class(None, status)
    return cls.code if status >= 400 and cls is not PeerError else f"http_{status}"
