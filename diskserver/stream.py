"""READ over the agent's block stream: a pool of WebSocket connections, many small requests on each.

A demand-paging miss is a READ of a few blocks that the guest waits on. Over HTTP each costs ~0.5 ms of
request handling at each end and ~300 bytes of headers; over a WebSocket a message costs tens of
microseconds and a few bytes of framing. The wire format is in :mod:`hashcache.hcp` (``*_stream_*``).

:class:`BlockStream` raises :class:`StreamRefused` for an answer the agent meant (its status says why;
401 at the handshake: the token), :class:`StreamUnsupported` when the server has no stream (another
refusal of the handshake, e.g. a 403 or 404 from an older agent or a proxy that does not pass
WebSockets), and lets ``OSError``/``websockets`` errors through as transient: the caller retries them.
"""

from __future__ import annotations

import collections
import socket
import ssl
import threading
from dataclasses import dataclass

from websockets.client import ClientProtocol
from websockets.exceptions import InvalidStatus
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from hashcache.hcp import decode_stream_reply, encode_stream_read

_FRAME = 6  # bytes of WebSocket framing per message, about (2-byte header + 4-byte client mask)


class StreamUnsupported(Exception):
    """The agent answers HTTP but has no block stream."""


@dataclass
class StreamRefused(Exception):
    status: int
    detail: str

    def __str__(self) -> str:
        return f"HTTP {self.status}: {self.detail}"


class _Connection:
    """One WebSocket on a plain socket, driven entirely by the calling thread (websockets' sans-I/O
    protocol): no reader thread to hand each reply over, which costs a GIL round trip per READ."""

    def __init__(self, ws_url: str, token: str, timeout: float) -> None:
        uri = parse_uri(ws_url)
        sock = socket.create_connection((uri.host, uri.port), timeout=min(5.0, timeout))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if uri.secure:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=uri.host)
            self.sock = sock
            self.proto = ClientProtocol(uri, max_size=64 << 20)
            self._events: collections.deque[object] = collections.deque()
            request = self.proto.connect()
            request.headers["Authorization"] = f"Bearer {token}"
            request.headers["User-Agent"] = "capsule-diskserver"
            self.proto.send_request(request)
            self._flush()
            while True:
                event = self._next_event(timeout)
                if isinstance(event, Response):
                    break
            if self.proto.handshake_exc is not None:
                raise self.proto.handshake_exc
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
        parts: list[bytes] = []
        while True:
            frame = self._next_event(timeout)
            if not isinstance(frame, Frame) or frame.opcode in (Opcode.PING, Opcode.PONG):
                continue
            if frame.opcode == Opcode.CLOSE:
                raise ConnectionError("the agent closed the block stream")
            if frame.opcode == Opcode.TEXT:
                raise StreamRefused(502, "a text message on the block stream")
            parts.append(frame.data)
            if frame.fin:
                return b"".join(parts)

    def close(self) -> None:
        self.sock.close()


class BlockStream:
    """A pool of WebSocket connections to one agent's ``/v1/objects/stream``: a READ takes an idle one
    (or opens one), and gives it back once answered. (Not thread-local: nbdkit's Python plugin gives a
    worker thread a fresh Python thread state per call, which would open a connection per READ.)"""

    def __init__(self, url: str, max_idle: int = 16) -> None:
        base = url.rstrip("/")
        self.ws_url = ("wss://" + base[8:] if base.startswith("https://") else "ws://" + base[7:]) + \
            "/v1/objects/stream"
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _take(self, token: str, timeout: float) -> tuple[_Connection, int]:
        """An idle connection, or a new one; and the bytes opening it cost."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), 0
        try:
            conn = _Connection(self.ws_url, token, timeout)
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status == 401:
                raise StreamRefused(status, "the block stream refused the token") from exc
            if status in (429, 500, 502, 503, 504):
                raise StreamRefused(status, exc.response.reason_phrase) from exc
            # 403/404/400…: a server (or a proxy in front of it) without the stream
            raise StreamUnsupported(f"{self.ws_url}: no block stream here (HTTP {status})") from exc
        return conn, 400  # the upgrade request and answer, about

    def _give_back(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def read(self, token: str, kind: str, oid: str, indices: list[int], level: int,
             timeout: float) -> tuple[bytes, int]:
        """The READ payload for ``indices`` and the bytes the exchange cost on the wire."""
        request = encode_stream_read(kind, oid, indices, level)
        conn, opening = self._take(token, timeout)
        try:
            reply = conn.exchange(request, timeout)
        except BaseException:
            conn.close()  # a half-answered connection cannot be reused
            raise
        self._give_back(conn)
        payload, err = decode_stream_reply(reply)
        wire = opening + len(request) + len(reply) + 2 * _FRAME
        if payload is None:
            raise StreamRefused(int(err.get("status", 500)), str(err.get("detail", "refused")))
        return payload, wire

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._idle = self._idle, []
        for conn in conns:
            conn.close()
