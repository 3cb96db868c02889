"""Where the agent's blocking work runs: two bounded thread pools, and a limit per owner on capsule operations.

- ``serving``: HCP (LOOKUP, READ-HASH, READ, the block stream's reads) and receiving (push's begin, blocks,
  commit, recording a version): short calls on the store that peers and demand-paged guests wait on;
- ``lifecycle``: start, stop, suspend, snapshot, derive, rm, activate, run, backups, pods, fleet pulls, verify:
  calls that may wait minutes on a guest or on another host.

Each is an anyio ``CapacityLimiter`` the routes name explicitly (:meth:`Workers.serve`, :meth:`Workers.act`), so
lifecycle calls that fill their pool queue behind each other and never delay block serving; what is left
(authentication, listings) runs in anyio's default pool, which neither fills.

An owner has at most ``per_owner`` capsule operations under way on this host at once (one waiting for a thread
counts; so does a dashboard migration, which runs in its own thread until it ends): one more is refused at once,
429 ``too_many_operations`` with ``Retry-After``, and changes nothing. Operators, admins and host tokens are not
counted per user: they act for the whole host (a fleet rollout activates capsules, a backup job snapshots them)
and are trusted with it; they share the bounded lifecycle pool with everyone, so they cannot delay block serving
either."""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from starlette.requests import HTTPConnection

from capsule.agent.authz import caller_of
from capsule.agent.limits import Limits
from capsule.errors import TooManyOperations

T = TypeVar("T")

RETRY_AFTER = 10      # seconds an owner over its limit is told to wait (operations take seconds to minutes)


class Ticket:
    """One admitted operation of one owner (``user`` None: not counted); :meth:`release` once it has ended."""

    def __init__(self, quota: OwnerQuota, user: str | None) -> None:
        self._quota, self.user = quota, user
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        """Give the count back (once: a second call does nothing)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        if self.user is not None:
            self._quota.give(self.user)


class OwnerQuota:
    """How many capsule operations each owner has under way, and the limit (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._busy: Counter[str] = Counter()

    def admit(self, conn: HTTPConnection) -> Ticket:
        """A ticket for the caller of ``conn``, or :class:`TooManyOperations` when it is an owner at its limit."""
        caller = caller_of(conn)
        principal = caller.principal if caller is not None else None
        if principal is None or principal.role != "owner":
            return Ticket(self, None)
        user = principal.user or "?"
        with self._lock:
            if self._busy[user] >= self.limit:
                raise TooManyOperations(
                    f"{user} already has {self._busy[user]} capsule operations under way on this host, the most "
                    f"one owner may have at once; try again when one has finished", retry_after=RETRY_AFTER,
                    limit=self.limit)
            self._busy[user] += 1
        return Ticket(self, user)

    def give(self, user: str) -> None:
        with self._lock:
            self._busy[user] -= 1
            if self._busy[user] <= 0:
                del self._busy[user]

    def under_way(self, user: str) -> int:
        with self._lock:
            return self._busy[user]


class Workers:
    """The pools and the per-owner limit of one agent (``app.state.workers``)."""

    def __init__(self, limits: Limits) -> None:
        self.serving = anyio.CapacityLimiter(limits.serving_workers)
        self.lifecycle = anyio.CapacityLimiter(limits.lifecycle_workers)
        self.quota = OwnerQuota(limits.per_owner)

    async def serve(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a thread of the serving pool."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.serving)

    async def act(self, conn: HTTPConnection, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a thread of the lifecycle pool, counted against the caller's limit until
        it returns (refused at once, :class:`TooManyOperations`, when the caller is an owner at its limit)."""
        ticket = self.quota.admit(conn)
        try:
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self.lifecycle)
        finally:
            ticket.release()


def workers_of(conn: HTTPConnection) -> Workers:
    workers: Workers = conn.app.state.workers
    return workers
