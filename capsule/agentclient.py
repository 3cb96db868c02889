"""The client of another host's agent: the one transport (:mod:`hashcache.transport`) with retry of
idempotent calls and byte counting, and the agent's typed errors raised again here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from capsule import __version__
from capsule.errors import InvalidName
from hashcache.transport import (
    Call,
    Counting,
    HttpTransport,
    RateLimited,
    Reply,
    Retrying,
    RetryPolicy,
    Transport,
    check,
    protocol,
)
from hashcache.transport import read_token as _read_token

# A connection that stalls or breaks is tried again after 1, 2, 4, 8, 16 s (on a congested slow link
# TCP can stall a connection for minutes); a refused one fails at once.
RETRY = RetryPolicy(delays=(1.0, 2.0, 4.0, 8.0, 16.0))


def read_token(token_file: Path | None) -> str:
    """The client's token: ``--token-file`` or ``CAPSULE_TOKEN``."""
    return _read_token(token_file)


class AgentClient:
    """Calls to one agent: its transport (HTTP(S) over TCP unless ``transport`` is given, e.g. an in-process
    one; over https the certificate pinned to ``fingerprint``, see :mod:`hashcache.transport.tls`), optionally
    rate-limited, with retry of idempotent calls, and byte counting (``wire_bytes``)."""

    def __init__(self, url: str, token: str, timeout: float = 120.0, *, transport: Transport | None = None,
                 retry: RetryPolicy = RETRY, rate: float | None = None, fingerprint: str | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidName(f"agent URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.peer: protocol.Peer | None = None      # the agent's release and protocol, from its last answer
        self.features: frozenset[str] = frozenset()  # what it serves beyond its protocol (protocol.FEATURES)
        base: Transport = transport or HttpTransport(
            self.url, token, timeout=timeout, connect_timeout=30.0, fingerprint=fingerprint,
            user_agent=protocol.user_agent(__version__))
        if rate is not None:  # bytes per second of request and answer bodies
            base = RateLimited(base, rate)
        self._counter = Counting(base)   # under the retries: every attempt's bytes count
        self._calls = Retrying(self._counter, retry)
        self.timeout: float = getattr(transport, "timeout", timeout)   # what a call may take before it is given up

    @property
    def wire_bytes(self) -> int:
        return self._counter.wire_bytes

    def retry_pauses(self) -> Iterator[float]:
        """The pauses before an idempotent call is tried again, in order (for a caller retrying by itself)."""
        return self._calls.policy.pauses()

    def close(self) -> None:
        self._calls.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, *, content: bytes | None = None, json_body: Any = None,
                params: dict[str, Any] | None = None, idempotent: bool | None = None) -> Reply:
        """One call; an error answer raises the agent's own error class with its message. An idempotent
        call (GETs, unless told otherwise) whose connection stalls or breaks is tried again (see RETRY)
        before :class:`~capsule.errors.Unreachable`."""
        if json_body is not None:
            content = json.dumps(json_body).encode()
        call = Call(method, path, params=params, content=content or b"", json=json_body is not None,
                    idempotent=(method == "GET") if idempotent is None else idempotent)
        reply = self._calls.call(call)
        self.features = protocol.features_of(reply.headers.get(protocol.FEATURES))
        self.peer = protocol.check(protocol.of_agent(reply.headers.get(protocol.HEADER)), __version__,
                                   f"the agent at {self.url}")
        return check(reply, f"agent {self.url}")

    def get_json(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params or None).json()

    def post_json(self, path: str, body: Any) -> Any:
        return self.request("POST", path, json_body=body).json()
