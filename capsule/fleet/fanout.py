"""Who sends the new version to whom. The origin (this host's store) can send to ``parallel`` hosts at
a time; with fan-out, every host that holds the version serves ``parallel`` more, so the number of
senders grows with each host done (a tree whose fan-out is bounded by ``parallel``). Without fan-out the
origin sends to everyone. In a rollout ``--via`` a repository, the repository takes the origin's place
(``last_resort=REPOSITORY``): hosts that hold the version serve first, and the repository, ``parallel`` hosts at
a time, serves the rest; the origin sends to no host.

The same ``Sources`` object decides during a rollout (``take``/``release``) and in ``plan_tree``, which
replays it with every transfer taking one round: the tree a rollout makes when all links are equal."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from capsule.errors import InvalidName

ORIGIN = ""  # the origin's name among the sources (no host has an empty name)
REPOSITORY = "@repository"   # a rollout --via's repository among the sources (no host name has an '@')
MAX_PARALLEL = 64


class Sources:
    """Senders with a free slot. A peer is preferred to the source of last resort — the origin, or the
    repository of a rollout --via (the origin's uplink is the one every rollout shares) — and the least busy
    peer first, the earliest holder on a tie."""

    def __init__(self, parallel: int, holders: Iterable[str] = (), *, fanout: bool = True,
                 last_resort: str = ORIGIN) -> None:
        if not 1 <= parallel <= MAX_PARALLEL:
            raise InvalidName(f"--parallel must be 1..{MAX_PARALLEL}, not {parallel}")
        if last_resort not in (ORIGIN, REPOSITORY):
            raise InvalidName(f"the source of last resort is the origin or the repository, not {last_resort!r}")
        self.parallel = parallel
        self.fanout = fanout
        self.last_resort = last_resort
        self._busy: dict[str, int] = {last_resort: 0}
        self._order: list[str] = []
        self._lock = threading.Lock()
        for h in holders:
            self.add(h)

    def add(self, host: str) -> None:
        """``host`` now holds the version: with fan-out it serves others."""
        with self._lock:
            if self.fanout and host not in self._busy:
                self._busy[host] = 0
                self._order.append(host)

    def take(self) -> str | None:
        """A sender with a free slot (ORIGIN or REPOSITORY for the last resort), its slot taken; None if all
        are busy."""
        with self._lock:
            free = [h for h in self._order if self._busy[h] < self.parallel]
            if free:
                best = min(free, key=lambda h: (self._busy[h], self._order.index(h)))
            elif self._busy[self.last_resort] < self.parallel:
                best = self.last_resort
            else:
                return None
            self._busy[best] += 1
            return best

    def release(self, source: str) -> None:
        with self._lock:
            self._busy[source] -= 1


@dataclass(frozen=True)
class Edge:
    host: str
    source: str   # ORIGIN, REPOSITORY or a host
    round: int    # 0-based: when every transfer takes one round


def plan_tree(hosts: list[str], holders: list[str], parallel: int, *, fanout: bool = True,
              last_resort: str = ORIGIN) -> list[Edge]:
    """The transfers of ``hosts`` (in order) when each takes one round."""
    sources = Sources(parallel, holders, fanout=fanout, last_resort=last_resort)
    waiting = list(hosts)
    edges: list[Edge] = []
    rnd = 0
    while waiting:
        started: list[tuple[str, str]] = []
        while waiting and (src := sources.take()) is not None:
            started.append((waiting.pop(0), src))
        for host, src in started:
            edges.append(Edge(host, src, rnd))
            sources.release(src)
            sources.add(host)
        rnd += 1
    return edges
