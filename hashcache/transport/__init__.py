"""One client side for an agent's HCP and management calls: a tiny :class:`Transport` interface and
wrappers around it (restic's backend and its decorators are the model).

Implementations:

- :class:`HttpTransport` — httpx over TCP (any call);
- :class:`StreamTransport` — READ over the agent's block stream (a pool of WebSockets), every other
  call (and READ from an agent without a stream) through the transport it wraps;
- :func:`memory.in_process` — the same two, driven in-process against an ASGI app (the unit tier).

Wrappers: :class:`Retrying` (idempotent calls only, back-off; a refused connection fails at once unless
the policy says otherwise; a 401 is never retried), :class:`Counting` (bytes on the wire),
:class:`RateLimited` (a token bucket). :func:`check` turns an error reply into the typed error the
peer raised (same class, same message, prefixed with the host that said it).

Over https every connection (HTTP, the block stream, asyncio WebSockets) uses :mod:`hashcache.transport.tls`:
the peer's certificate pinned by its SHA-256 fingerprint, or CA-validated when no pin is given.
"""

from hashcache.transport.base import Call, Reply, Transport, check, read_call, read_token
from hashcache.transport.http import HttpTransport
from hashcache.transport.stream import BlockStream, StreamTransport
from hashcache.transport.wrappers import Counting, RateLimited, Retrying, RetryPolicy

__all__ = ["BlockStream", "Call", "Counting", "HttpTransport", "RateLimited", "Reply", "RetryPolicy", "Retrying",
           "StreamTransport", "Transport", "check", "read_call", "read_token"]
