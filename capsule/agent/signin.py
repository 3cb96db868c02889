"""Signing in to the dashboard: the limits first, then the password in its own small pool, then a session.

1. The per-address and per-user limits (:class:`~capsule.agent.sessions.Attempts`) are checked before any
   password is hashed: a refused attempt costs no scrypt. The attempt counts against both until its outcome is
   known, so a burst of attempts at once cannot all pass the check together.
2. The password is checked (scrypt: tens of milliseconds and 32 MiB each) in :class:`HashPool`: at most
   ``threads`` at once, each in a worker thread, and at most ``queue`` more waiting in the event loop (not in a
   thread); beyond that the answer is 429 with ``Retry-After`` at once. A flood of sign-ins so never takes the
   agent's worker threads from its other calls, nor its memory.
3. The session keeps the user's password stamp (``users.password_stamp``); :func:`live` ends it once the stored
   password changes (``capsule user passwd``, even while the agent runs), at the session's next call.

The client address is the connection's (``request.client``): the web server puts a proxy's ``X-Forwarded-For``
there only for proxies it was told to trust; nothing here reads that header."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from capsule.accounts import tokens, users
from capsule.accounts.model import Principal, legacy_principal
from capsule.agent.sessions import Attempts, Session, Sessions, unauthorized
from capsule.errors import AuthFailed, TooManyAttempts
from capsule.store import Store

THREADS = 2        # passwords hashed at once
QUEUE = 8          # sign-ins waiting for one of them
T = TypeVar("T")


class HashPool:
    """Where passwords are checked: ``threads`` at once, ``queue`` more waiting, the rest refused (429)."""

    def __init__(self, threads: int = THREADS, queue: int = QUEUE) -> None:
        self.threads, self.queue = threads, queue
        self.limiter = anyio.CapacityLimiter(threads)
        self._lock = threading.Lock()
        self._inside = 0          # hashing or waiting to

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if self._inside >= self.threads + self.queue:
                raise TooManyAttempts(f"too many sign-ins at once ({self._inside} under way): try again in 1 s",
                                      retry_after=1)
            self._inside += 1
        try:
            return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=self.limiter)
        finally:
            with self._lock:
                self._inside -= 1


async def sign_in(store: Store, sessions: Sessions, attempts: Attempts, pool: HashPool, *, address: str,
                  user: str | None, password: str | None, token: str | None) -> Session:
    """A new session for a right user name and password (or the host's token while no admin exists); else
    :class:`AuthFailed` (the bare 401), or :class:`TooManyAttempts` over a limit or with the pool full."""
    keys = [f"address:{address}"] + ([f"user:{user}"] if user is not None else [])
    attempts.begin(*keys)
    found: tuple[Principal, str | None] | None = None
    wrong = False        # (the pool's refusal, or the host token's end, is no wrong password: not counted)
    try:
        if user is not None:
            found = await pool.run(users.check_password, store, user, password or "")
        elif sessions.check_token(token or ""):
            if await anyio.to_thread.run_sync(users.admin_exists, store):
                raise AuthFailed(tokens.LEGACY_GONE)
            found = legacy_principal(), None
        wrong = found is None
    finally:
        attempts.done(*keys, failed=wrong)
    if found is None:
        raise unauthorized()
    return sessions.create(*found)


def live(store: Store) -> Callable[[Session], bool]:
    """Whether a session still stands: made with the host's token, or its user's password unchanged since. (A
    removed user's session is ended by the guard, which says so.)"""
    def check(session: Session) -> bool:
        if session.principal.user is None:
            return True
        stamp = users.password_stamp(store, session.principal.user)
        return stamp is None or stamp == session.stamp

    return check
