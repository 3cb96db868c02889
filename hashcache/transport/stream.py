"""READ over the agent's block stream: a pool of WebSocket connections, many small requests on each.

A demand-paging miss is a READ of a few blocks that the guest waits on. Over HTTP each costs ~0.5 ms of
request handling at each end and ~300 bytes of headers; over a WebSocket a message costs tens of
microseconds and a few bytes of framing. The wire format is in :mod:`hashcache.hcp` (``*_stream_*``).

:class:`StreamTransport` sends READ calls over the stream and every other call through the transport
it wraps. The agent's refusals come back as replies (status and JSON body, as over HTTP); a server
without the stream (the handshake is refused with 403/404/400: an older agent, or a proxy that does
not pass WebSockets) makes it send READs over the wrapped transport from then on.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import socket
import threading
from collections.abc import Callable
from typing import Protocol

from websockets.client import ClientProtocol
from websockets.exceptions import InvalidStatus, WebSocketException
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from hashcache.bounds import HTTP_ERROR
from hashcache.errors import Unreachable
from hashcache.hcp import decode_stream_reply, encode_stream_read
from hashcache.transport import plain, protocol, tls
from hashcache.transport.base import Call, Reply, TokenSource, Transport

log = logging.getLogger("hashcache.transport")

_FRAME = 6  # bytes of WebSocket framing per message, about (2-byte header + 4-byte client mask)
_OPENING = 400  # the upgrade request and answer, about
_READ = re.compile(r"/v1/objects/(layer|file)/([0-9a-f]{64})/read")
STREAM_PATH = "/v1/objects/stream"


class HandshakeRefused(Exception):
    """The server answered the upgrade with an HTTP status instead of a WebSocket."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status}: {reason}")
        self.status = status
        self.reason = reason


class Connection(Protocol):
    def exchange(self, message: bytes, timeout: float) -> bytes: ...

    def close(self) -> None: ...


Connector = Callable[[str, float], Connection]
"""Opens one stream connection with a token (and a timeout); raises :class:`HandshakeRefused`."""


class _Connection:
    """One WebSocket on a plain socket, driven entirely by the calling thread (websockets' sans-I/O
    protocol): no reader thread to hand each reply over, which costs a GIL round trip per READ."""

    def __init__(self, ws_url: str, token: str, timeout: float, fingerprint: str | None = None) -> None:
        uri = parse_uri(ws_url)
        sock = socket.create_connection((uri.host, uri.port), timeout=min(5.0, timeout))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if uri.secure:
                sock = tls.client_context(fingerprint).wrap_socket(sock, server_hostname=uri.host)
            self.sock = sock
            self.proto = ClientProtocol(uri, max_size=64 << 20)
            self._events: collections.deque[object] = collections.deque()
            request = self.proto.connect()
            request.headers["Authorization"] = f"Bearer {token}"
            request.headers["User-Agent"] = protocol.user_agent()
            self.proto.send_request(request)
            self._flush()
            while True:
                event = self._next_event(timeout)
                if isinstance(event, Response):
                    break
            if self.proto.handshake_exc is not None:
                raise self.proto.handshake_exc
        except InvalidStatus as exc:
            sock.close()
            raise HandshakeRefused(exc.response.status_code, exc.response.reason_phrase) from exc
        except BaseException:
            sock.close()
            raise

    def _flush(self) -> None:
        for chunk in self.proto.data_to_send():
            if chunk:
                self.sock.sendall(chunk)

    def _next_event(self, timeout: float) -> object:
        self.sock.settimeout(timeout)
        while not self._events:
            data = self.sock.recv(1 << 20)
            if data:
                self.proto.receive_data(data)
            else:
                self.proto.receive_eof()
            self._flush()  # e.g. the pong to a ping
            self._events.extend(self.proto.events_received())
            if not data and not self._events:
                raise ConnectionError("the agent closed the block stream")
        return self._events.popleft()

    def exchange(self, message: bytes, timeout: float) -> bytes:
        """Send one binary message and return the binary reply."""
        self.proto.send_binary(message)
        self._flush()
        parts: list[bytes | bytearray | memoryview] = []
        while True:
            frame = self._next_event(timeout)
            if not isinstance(frame, Frame) or frame.opcode in (Opcode.PING, Opcode.PONG):
                continue
            if frame.opcode == Opcode.CLOSE:
                raise ConnectionError("the agent closed the block stream")
            if frame.opcode == Opcode.TEXT:
                raise ConnectionError("a text message on the block stream")
            parts.append(frame.data)
            if frame.fin:
                return b"".join(parts)

    def close(self) -> None:
        self.sock.close()


def socket_connector(url: str, fingerprint: str | None = None) -> Connector:
    """Connections over TCP to the agent at ``url`` (http:// → ws://, https:// → wss:// with the certificate
    pinned to ``fingerprint``, or CA-validated without one: :func:`hashcache.transport.tls.client_context`);
    ws:// to another machine refused unless configured (:func:`hashcache.transport.plain.check`)."""
    base = url.rstrip("/")
    plain.check(base)
    ws_url = ("wss://" + base[8:] if base.startswith("https://") else "ws://" + base[7:]) + STREAM_PATH
    return lambda token, timeout: _Connection(ws_url, token, timeout, fingerprint)


class StreamUnsupported(Exception):
    """The agent answers HTTP but has no block stream."""


class BlockStream:
    """A pool of stream connections to one agent: a READ takes an idle one (or opens one), and gives it
    back once answered. (Not thread-local: nbdkit's Python plugin gives a worker thread a fresh Python
    thread state per call, which would open a connection per READ.)"""

    def __init__(self, connect: Connector, max_idle: int = 16) -> None:
        self.connect = connect
        self.max_idle = max_idle
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _take(self, token: str, timeout: float) -> tuple[Connection, int]:
        """An idle connection, or a new one; and the bytes opening it cost."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), 0
        try:
            return self.connect(token, timeout), _OPENING
        except HandshakeRefused as exc:
            if exc.status == 401 or exc.status == 429 or exc.status >= 500:
                raise
            # 403/404/400…: a server (or a proxy in front of it) without the stream
            raise StreamUnsupported(f"no block stream here (HTTP {exc.status})") from exc

    def _give_back(self, conn: Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def exchange(self, token: str, request: bytes, timeout: float) -> tuple[bytes, int]:
        """The reply to one request and the bytes the exchange cost on the wire."""
        conn, opening = self._take(token, timeout)
        try:
            reply = conn.exchange(request, timeout)
        except BaseException:
            conn.close()  # a half-answered connection cannot be reused
            raise
        self._give_back(conn)
        return reply, opening + len(request) + len(reply) + 2 * _FRAME

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._idle = self._idle, []
        for conn in conns:
            conn.close()


class StreamTransport:
    """READ calls over the block stream; everything else (and READ once the agent turns out to have no
    stream) through ``inner``."""

    def __init__(self, inner: Transport, token: TokenSource, connect: Connector | None = None,
                 *, timeout: float = 30.0, max_idle: int = 16) -> None:
        self.inner = inner
        self.url = inner.url
        self.token = token
        self.timeout = timeout
        # the stream trusts the peer exactly as the wrapped transport does (its pin, if it has one)
        pin = getattr(inner, "fingerprint", None)
        self._stream: BlockStream | None = BlockStream(connect or socket_connector(inner.url, pin), max_idle)

    @property
    def active(self) -> bool:
        """False once the agent turned out to have no stream."""
        return self._stream is not None

    @property
    def stream(self) -> BlockStream | None:
        return self._stream

    def call(self, call: Call) -> Reply:
        m = _READ.fullmatch(call.path) if call.method == "POST" else None
        stream = self._stream
        if m is None or stream is None:
            return self.inner.call(call)
        params = call.params or {}
        level = 0 if str(params.get("compress", "true")).lower() == "false" else int(params.get("level", 3))
        request = encode_stream_read(m.group(1), m.group(2), [], level) + call.content
        timeout = call.timeout or self.timeout
        try:
            raw, wire = stream.exchange(self.token.value, request, timeout)
        except StreamUnsupported:
            log.info("the agent at %s has no block stream: READs go over HTTP", self.url)
            self._stream = None
            stream.close()
            return self.inner.call(call)
        except HandshakeRefused as exc:
            detail = "the block stream refused the token" if exc.status == 401 else exc.reason
            return Reply(exc.status, json.dumps({"detail": detail}).encode(), {}, _OPENING)
        except (OSError, TimeoutError, WebSocketException) as exc:
            if bad := tls.cause(exc):
                raise tls.explain(self.url, bad) from exc
            text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise Unreachable(f"cannot reach the agent at {self.url} (block stream): {text}",
                              refused=isinstance(exc, ConnectionRefusedError)) from exc
        payload, err = decode_stream_reply(raw)  # a malformed reply: ProtocolError
        if payload is None:
            status = err.get("status")
            status = status if isinstance(status, int) and HTTP_ERROR.contains(status) else 502
            body = {k: v for k, v in err.items() if k != "status"}
            return Reply(status, json.dumps(body).encode(), {}, wire)
        return Reply(200, payload, {}, wire)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.inner.close()
