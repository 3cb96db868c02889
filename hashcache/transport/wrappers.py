"""Wrappers around a :class:`~hashcache.transport.base.Transport`: retry, byte counting, rate limiting,
and reading a rotated token again. Each is a transport itself, so they stack."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hashcache.errors import Error, InvalidInput, Unreachable
from hashcache.transport.base import Call, Reply, TokenSource, Transport, error_of

log = logging.getLogger("hashcache.transport")


@dataclass(frozen=True)
class RetryPolicy:
    """When a call is sent again. Only idempotent calls are, and never after a 401.

    Either a fixed list of pauses (``delays``), or, with ``deadline``, pauses doubling from
    ``initial_delay`` up to ``max_delay`` until ``deadline`` seconds have passed since the first try
    (each try's timeout is then cut to the time left)."""

    delays: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0)
    deadline: float | None = None
    initial_delay: float = 0.05
    max_delay: float = 1.0
    retry_refused: bool = False                 # a refused connection (nobody listens) is tried again
    retry_status: frozenset[int] = frozenset()  # answers worth another try (e.g. 503)

    def pauses(self) -> Iterator[float]:
        if self.deadline is None:
            yield from self.delays
            return
        delay = self.initial_delay
        while True:
            yield delay
            delay = min(delay * 2, self.max_delay)


class Retrying:
    """Sends an idempotent call again, with back-off, when it got no answer (or an answer the policy
    names); gives up with :class:`Unreachable` saying how many attempts were made and the last error."""

    def __init__(self, inner: Transport, policy: RetryPolicy | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # a test may pass a fake clock's sleep
        self.inner = inner
        self.url = inner.url
        self.policy = policy or RetryPolicy()
        self._sleep = sleep

    def call(self, call: Call) -> Reply:
        if not call.idempotent:
            return self.inner.call(call)
        policy = self.policy
        retry_status = policy.retry_status - {401}
        start = time.monotonic()
        end = start + policy.deadline if policy.deadline is not None else None
        pauses = policy.pauses()
        attempts = 0
        last: Error
        while True:
            attempts += 1
            c = call
            if end is not None:
                left = end - time.monotonic()
                c = call.with_timeout(max(0.5, min(call.timeout or left, left)))
            try:
                reply = self.inner.call(c)
            except Unreachable as exc:
                if exc.refused and not policy.retry_refused:
                    raise
                last = exc
            else:
                if reply.status not in retry_status:
                    if attempts > 1:
                        log.warning("%s is answering again (after %d attempts, %.1f s)", self.url, attempts,
                                    time.monotonic() - start)
                    reply.attempts = attempts
                    return reply
                last = error_of(reply, f"the agent at {self.url}")
            pause = next(pauses, None)
            now = time.monotonic()
            if pause is None or (end is not None and now >= end):
                raise Unreachable(f"{last} ({attempts} attempts in {now - start:.1f} s)",
                                  refused=getattr(last, "refused", False)) from last
            if attempts == 1:
                log.warning("%s: %s; trying again", self.url, last)
            self._sleep(pause if end is None else min(pause, max(0.0, end - now)))

    def close(self) -> None:
        self.inner.close()


class Counting:
    """Adds up the bytes every call cost on the wire (``wire_bytes``): what an answered call says, and for a
    call that failed (a timeout, a broken link) its request body, which may well have crossed. Put it under
    the retrying wrapper, so that every attempt counts."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.url = inner.url
        self._lock = threading.Lock()
        self.wire_bytes = 0
        self.calls = 0

    def call(self, call: Call) -> Reply:
        try:
            reply = self.inner.call(call)
        except Exception:
            with self._lock:
                self.wire_bytes += len(call.content)
                self.calls += 1
            raise
        with self._lock:
            self.wire_bytes += reply.wire_bytes
            self.calls += 1
        return reply

    def close(self) -> None:
        self.inner.close()


class RateLimited:
    """Holds calls back so that request and answer bodies stay under ``bytes_per_second`` on average
    (a token bucket of ``burst`` bytes; a body larger than the bucket waits until it is paid for)."""

    def __init__(self, inner: Transport, bytes_per_second: float, burst: float | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if bytes_per_second <= 0:
            raise InvalidInput(f"a rate limit must be above 0 bytes per second, not {bytes_per_second}")
        self.inner = inner
        self.url = inner.url
        self.rate = float(bytes_per_second)
        self.burst = float(burst if burst is not None else bytes_per_second)
        self._tokens = self.burst
        self._t = time.monotonic()
        self._lock = threading.Lock()
        self._sleep = sleep

    def _take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate) - n
            self._t = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)

    def call(self, call: Call) -> Reply:
        self._take(len(call.content))
        reply = self.inner.call(call)
        self._take(len(reply.content))
        return reply

    def close(self) -> None:
        self.inner.close()


class Reauthenticating:
    """On a 401, reads the token file again and, only if the token changed (it was rotated), sends the
    call once more. A 401 with the same token is returned as is: it is never retried."""

    def __init__(self, inner: Transport, token: TokenSource) -> None:
        self.inner = inner
        self.url = inner.url
        self.token = token

    def call(self, call: Call) -> Reply:
        reply = self.inner.call(call)
        if reply.status == 401 and self.token.reload():
            reply = self.inner.call(call)
        return reply

    def close(self) -> None:
        self.inner.close()
