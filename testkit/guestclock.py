"""How long a guest was paused, as the guest lived it.

A guest's own clocks stand still while QEMU has it stopped: its uptime (CLOCK_BOOTTIME, ``/proc/uptime``) does
not count a pause, a switchover or a save. So a counter the guest stamps with its own time never shows a gap,
however long the pause was. What shows it is the guest's clock against the host's: the offset
``host time − guest uptime`` is constant while the guest runs and grows by exactly the time it did not run.
Measured before and after a move (the compose hosts share this machine's clock), the growth is the pause.

Each offset is the best of a few samples, NTP-style: the host's time before and after the guest answers,
the guest's uptime taken as read at the midpoint; its error is half the round trip (plus the 10 ms resolution
of ``/proc/uptime``).

    before = offset(lambda cmd: a.guest(name, cmd))
    ... move ...
    after = offset(lambda cmd: b.guest(name, cmd))
    seconds, error = paused(before, after)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

UPTIME = "cat /proc/uptime"
RESOLUTION = 0.01      # /proc/uptime's


@dataclass(frozen=True)
class Offset:
    seconds: float     # host time − guest uptime
    error: float       # ± this much


def offset(run: Callable[[str], str], samples: int = 3, clock: Callable[[], float] = time.time) -> Offset:
    """The offset of the guest's uptime from the host's clock; ``run(command)`` runs a shell command in the
    guest and returns its output."""
    best: Offset | None = None
    for _ in range(samples):
        t0 = clock()
        out = run(UPTIME)
        t1 = clock()
        uptime = _uptime(out)
        cand = Offset((t0 + t1) / 2 - uptime, (t1 - t0) / 2 + RESOLUTION)
        if best is None or cand.error < best.error:
            best = cand
    assert best is not None, "samples must be at least 1"
    return best


def paused(before: Offset, after: Offset) -> tuple[float, float]:
    """The time the guest did not run between the two offsets, and its error (both in seconds)."""
    return after.seconds - before.seconds, before.error + after.error


def _uptime(out: str) -> float:
    for line in reversed(out.strip().splitlines()):
        first = line.split()[0] if line.split() else ""
        try:
            return float(first)
        except ValueError:
            continue
    raise ValueError(f"no uptime in the guest's answer {out[-200:]!r}")
