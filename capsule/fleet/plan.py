"""A rollout's stages: ``canary`` hosts first, then waves that reach cumulative shares of the hosts
(``10%,50%,100%``). Pure: hosts in, stages out.

The hosts are taken in the order given (the fleet's, by name), canaries first. A wave's share counts
the canaries: with 10 hosts, ``--canary 1 --waves 50%,100%`` is the stages [h1], [h2..h5], [h6..h10].
A share that adds nobody (``10%`` of 4 hosts after a canary) is no stage. Hosts beyond the last wave
(``--waves 50%``) are held back: the plan names them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from capsule.errors import InvalidName

MAX_WAVES = 20
_SHARE_RE = re.compile(r"^(\d{1,3})%$")


@dataclass(frozen=True)
class Stage:
    name: str                # "canary", "wave 1 (10%)", …
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    stages: tuple[Stage, ...]
    held_back: tuple[str, ...] = field(default=())

    def hosts(self) -> list[str]:
        return [h for s in self.stages for h in s.hosts]


def parse_waves(text: str) -> list[int]:
    """``10%,50%,100%`` → [10, 50, 100]: strictly increasing percentages in 1..100."""
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else []
    shares = []
    for p in parts:
        m = _SHARE_RE.match(p)
        if not m or not 1 <= int(m.group(1)) <= 100:
            raise InvalidName(f"invalid wave {p!r} in {text!r}: give percentages like 10%,50%,100%")
        shares.append(int(m.group(1)))
    if not shares or len(shares) > MAX_WAVES:
        raise InvalidName(f"give 1 to {MAX_WAVES} waves, like 10%,50%,100%")
    if any(b <= a for a, b in zip(shares, shares[1:], strict=False)):
        raise InvalidName(f"waves must grow: {text!r}")
    return shares


def plan_stages(hosts: list[str], canary: int = 0, waves: list[int] | None = None) -> Plan:
    """Canaries, then the waves; each host in exactly one stage or held back."""
    if len(set(hosts)) != len(hosts):
        raise InvalidName("a host is named twice")
    if canary < 0:
        raise InvalidName(f"--canary must be 0 or more, not {canary}")
    if canary > len(hosts):
        raise InvalidName(f"--canary {canary} is more than the {len(hosts)} hosts of the rollout")
    waves = [100] if waves is None else waves
    stages: list[Stage] = []
    if canary:
        stages.append(Stage("canary", tuple(hosts[:canary])))
    reached = canary
    for i, share in enumerate(waves, 1):
        upto = max(reached, math.ceil(len(hosts) * share / 100))
        if upto > reached:
            stages.append(Stage(f"wave {i} ({share}%)", tuple(hosts[reached:upto])))
            reached = upto
    return Plan(tuple(stages), tuple(hosts[reached:]))
