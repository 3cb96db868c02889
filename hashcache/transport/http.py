"""The HTTP implementation of :class:`~hashcache.transport.base.Transport` (httpx)."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx

from hashcache.errors import Unreachable
from hashcache.transport import plain, protocol, tls
from hashcache.transport.base import Call, Reply, TokenSource

# a connection that stalled or broke; anything else (refused, unknown host) means nobody listens
STALLED = (httpx.TimeoutException, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


# a TLS handshake the peer cut short: someone listens (a refused connection never reaches the handshake)
_TLS_CUT = ("eof occurred in violation of protocol", "unexpected_eof_while_reading")


def _reset(exc: BaseException) -> bool:
    """A connection reset, or its TLS handshake cut short, while it opened (a link, a middlebox or a busy
    agent failing it, not nobody listening)."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen).lower()
        if isinstance(seen, (ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError)) \
                or "connection reset" in text or any(t in text for t in _TLS_CUT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _token(token: TokenSource | str | Path) -> TokenSource:
    if isinstance(token, TokenSource):
        return token
    if isinstance(token, Path):
        return TokenSource.from_file(token)
    return TokenSource(token)


class HttpTransport:
    """Calls over HTTP(S). ``client`` (an ``httpx.Client`` whose base URL is the agent) replaces the
    default pool, e.g. with one that drives an ASGI app in-process. Over https the peer's certificate must
    have the ``fingerprint`` (``SHA256:…``) pinned for it, or without one pass the system's CA validation
    (:mod:`hashcache.transport.tls`). Over plain HTTP to another machine it is refused before any connection
    unless this process was configured insecure (:mod:`hashcache.transport.plain`)."""

    def __init__(self, url: str, token: TokenSource | str | Path, *, timeout: float = 120.0,
                 connect_timeout: float = 30.0, max_connections: int = 32, user_agent: str = protocol.user_agent(),
                 client: httpx.Client | None = None, fingerprint: str | None = None) -> None:
        self.url = url.rstrip("/")
        if client is None:  # connections of its own: a token in clear only to loopback, unless configured
            plain.check(self.url)
        self.fingerprint = fingerprint
        self.token = _token(token)
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        # minimal headers: on a 384 kbit/s link every byte of every request counts
        self._client = client or httpx.Client(
            base_url=self.url, timeout=httpx.Timeout(timeout, connect=min(connect_timeout, timeout)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            verify=tls.client_context(fingerprint) if self.url.startswith("https://") else True)
        self._client.headers.update({"User-Agent": user_agent, "Accept": "*/*", "Accept-Encoding": "identity"})

    def call(self, call: Call) -> Reply:
        headers = {"Authorization": self.token.header}
        if call.json:
            headers["Content-Type"] = "application/json"
        kw: dict[str, Any] = {}  # no timeout argument at all unless the call has one (the test client warns)
        if call.timeout is not None:
            kw["timeout"] = httpx.Timeout(call.timeout, connect=min(self.connect_timeout, call.timeout))
        try:
            resp = self._client.request(call.method, call.path, params=call.params,
                                        content=call.content if call.method != "GET" else None, headers=headers,
                                        **kw)
        except httpx.TransportError as exc:
            if bad := tls.cause(exc):
                raise tls.explain(self.url, bad) from exc
            raise Unreachable(f"cannot reach the agent at {self.url}: {str(exc) or type(exc).__name__}",
                              refused=not isinstance(exc, STALLED) and not _reset(exc)) from exc
        return Reply(resp.status_code, resp.content, resp.headers, wire_bytes(resp, len(call.content)))

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"HttpTransport({self.url!r})"


def wire_bytes(resp: httpx.Response, body_len: int) -> int:
    """Request and answer, headers included (about: HTTP/1.1 framing)."""
    req = resp.request
    head = sum(len(k) + len(v) + 4 for k, v in req.headers.raw) + len(req.url.raw_path) + 16
    head += sum(len(k) + len(v) + 4 for k, v in resp.headers.raw) + 17
    return head + body_len + resp.num_bytes_downloaded
