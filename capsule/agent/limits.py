"""What one client may ask of the agent, bounded where the connection is made.

Bodies of uploads have their own limits in the routes that read them (a manifest, a batch of blocks);
every other request body is bounded here (`BodyLimit`). Below the web framework, uvicorn's HTTP protocol is
wrapped (`guarded_protocols`) so that

* one client address holds at most ``per_client`` connections at once (HTTP and WebSocket alike): one more
  is answered ``429`` with a JSON error saying so and closed, and other clients are served as before;
* a connection must complete a request's headers within ``header_timeout`` seconds of being opened, or, on a
  kept-alive connection, of the first byte of its next request: a slow-loris client that trickles its
  headers is answered ``408`` and closed instead of holding the connection for ever (uvicorn keeps a
  connection whose headers never end); an idle kept-alive connection is left to uvicorn's keep-alive timeout;
* a request's body must keep arriving: in every ``header_timeout`` seconds while it is being received, at
  least ``min_body_rate`` bytes per second of it (unless the agent itself paused reading it), or the request
  is answered ``408`` and the connection closed (a slow-loris client trickling a body a byte at a time held
  its connection for ever);
* an answer that stops leaving (the client does not read it, its queue does not shrink) for
  ``STALLED_PERIODS`` keep-alive timeouts gets its connection closed (uvicorn waited for ever to write it),
  and aborted if its queue still does not shrink for ``ABORT_PERIODS`` more (a close waits for ever to flush
  what a client never reads, holding the connection and its count);
* a WebSocket message is at most ``ws_max_message`` bytes (a block-stream request or a console frame is far
  smaller): over it the connection is closed with code 1009, "message too big".

and a kept-alive connection counts as idle only once its last answer has left: uvicorn starts the
keep-alive timeout when it has handed the answer to the socket, and on a slow link the answer may still be
queued there for minutes (closing then cut TLS answers off: 8 × 1 MiB READ answers at 384 kbit/s all
failed after ~2 minutes). While the socket's queue drains the timeout starts again; a client that stops
reading altogether is closed after ``STALLED_PERIODS`` timeouts without progress.

The limits are per agent process (`Limits`); `capsule serve` takes them from its options. They also size the
agent's two thread pools and the number of capsule operations one owner may have under way (`workers.py`).
Importing this module does not import the web server (the CLI reads the defaults from it)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import struct
import termios
from collections import Counter
from dataclasses import dataclass
from typing import Any

from capsule.errors import InvalidName, RequestTooLarge
from hashcache.errors import Error, Overloaded, RequestTimeout

#: Keep-alive periods in a row in which a connection's queued answer did not move before it is closed.
STALLED_PERIODS = 2
#: Keep-alive periods after that close in which the queue did not shrink before the connection is aborted.
ABORT_PERIODS = 2 * STALLED_PERIODS

#: Routes whose bodies are bounded by the route itself (the receiving side of push: manifests and batches).
OWN_LIMIT_PREFIXES = ("/v1/recv/",)


@dataclass(frozen=True)
class Limits:
    per_client: int = 64             # connections at once from one address
    header_timeout: float = 20.0     # seconds to complete a request's headers
    # seconds a connection without requests is kept: well past a batch's round trip on a slow link, where
    # reopening one means a SYN that may wait behind a full queue
    keep_alive: float = 75.0
    max_body: int = 1 << 20          # bytes of any request body without a limit of its own
    ws_max_message: int = 1 << 20    # bytes of one WebSocket message
    min_body_rate: float = 64.0      # bytes/s a request body must average over each header_timeout
    # threads for HCP and receiving, and for capsule operations (start, stop, …): see workers.py
    serving_workers: int = 32
    lifecycle_workers: int = 16
    per_owner: int = 2               # capsule operations one owner may have under way at once

    def __post_init__(self) -> None:
        if (self.per_client < 1 or self.header_timeout <= 0 or self.keep_alive <= 0 or self.max_body < 1
                or self.ws_max_message < 1024 or self.min_body_rate < 0 or self.serving_workers < 1
                or self.lifecycle_workers < 1 or self.per_owner < 1):
            raise InvalidName(f"limits out of range: {self}")


def _raw_reply(exc: Error, reason: bytes, extra: list[tuple[bytes, bytes]]) -> bytes:
    """An HTTP/1.1 answer written straight to the connection, below the web framework: the error's status and
    its usual JSON body (``{"error": code, "detail": message}``), then the connection closes."""
    body = json.dumps(exc.to_wire()).encode()
    head = [f"HTTP/1.1 {exc.http_status} ".encode() + reason, b"content-type: application/json",
            b"content-length: " + str(len(body)).encode(), b"connection: close",
            *(name + b": " + value for name, value in extra)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class _Counts:
    """Connections per client address, shared by the HTTP and WebSocket protocol objects of one server."""

    def __init__(self) -> None:
        self.by_address: Counter[str] = Counter()

    def take(self, address: str, limit: int) -> bool:
        if self.by_address[address] >= limit:
            return False
        self.by_address[address] += 1
        return True

    def give(self, address: str) -> None:
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]


def unsent_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes of answers not yet taken by the peer: the transport's own buffer plus the socket's send queue
    (``SIOCOUTQ``: not yet sent or not yet acknowledged); 0 where the socket cannot say."""
    left = transport.get_write_buffer_size() if isinstance(transport, asyncio.WriteTransport) else 0
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            left += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return left


def _address(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"


def guarded_protocols(limits: Limits) -> tuple[type[asyncio.Protocol], type[asyncio.Protocol]]:
    """uvicorn's HTTP (h11) and WebSocket protocol classes with ``limits`` applied: pass them to uvicorn as
    ``http=`` and ``ws=``, with ``ws_max_size=limits.ws_max_message``."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    counts = _Counts()
    ws_base: Any = AutoWebSocketsProtocol
    assert ws_base is not None, "uvicorn found no WebSocket library (websockets is a dependency)"

    class GuardedHTTP(H11Protocol):
        _counted: str | None = None
        _header_timer: asyncio.TimerHandle | None = None
        _unsent_before: int | None = None   # bytes left to send when the keep-alive timeout last ended
        _stalled = 0                        # keep-alive periods since the last progress in sending
        _body_timer: asyncio.TimerHandle | None = None
        _body_bytes = 0                     # bytes received since the body timer was last armed
        _write_timer: asyncio.TimerHandle | None = None
        _write_stalled = 0
        _write_left: int | None = None
        _lost = False
        _upgraded = False                   # the connection is a WebSocket's now

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            super().connection_made(transport)  # type: ignore[arg-type]
            address = _address(transport)
            if not counts.take(address, limits.per_client):
                self.transport.write(_raw_reply(Overloaded(
                    f"too many connections from {address} at once (at most {limits.per_client}); "
                    "close some or wait for them to finish"), b"Too Many Requests", [(b"retry-after", b"1")]))
                self.transport.close()
                return
            self._counted = address
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(limits.header_timeout, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            self.transport.write(_raw_reply(RequestTimeout(
                f"the request's headers did not arrive within {limits.header_timeout:g} s"), b"Request Timeout", []))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._counted is None:
                return  # refused: whatever it sends is dropped
            self._unsent_before = None
            self._body_bytes += len(data)
            super().data_received(data)
            if self._upgraded:
                return      # a WebSocket now (handle_websocket_upgrade ran inside): no HTTP timer for it
            if self.conn.their_state is h11.SEND_BODY and self._body_timer is None and limits.min_body_rate:
                self._body_bytes = 0
                self._body_timer = self.loop.call_later(limits.header_timeout, self._body_check)
            if self.transport.is_closing():
                self._disarm_header_timer()
            elif self.conn.their_state is h11.IDLE:
                # headers begun but incomplete (on a new connection the timer runs since it opened; on a
                # kept-alive one, idle until now under uvicorn's keep-alive timeout, since this first byte)
                self._arm_header_timer()
            else:
                self._disarm_header_timer()

        def _body_check(self) -> None:
            """Every ``header_timeout`` while a request's body arrives: too few bytes came (and not because
            the agent paused reading): 408 (if no answer has begun) and close."""
            self._body_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
                return
            if self._body_bytes >= limits.min_body_rate * limits.header_timeout or self.flow.read_paused:
                self._body_bytes = 0
                self._body_timer = self.loop.call_later(limits.header_timeout, self._body_check)
                return
            if self.conn.our_state is h11.SEND_RESPONSE:
                self.transport.write(_raw_reply(RequestTimeout(
                    f"the request's body arrived slower than {limits.min_body_rate:g} bytes/s over "
                    f"{limits.header_timeout:g} s"), b"Request Timeout", []))
            self.transport.close()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_stalled, self._write_left = 0, unsent_bytes(self.transport)
                self._write_timer = self.loop.call_later(self.timeout_keep_alive, self._write_check)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_check(self) -> None:
            """Every keep-alive timeout while writing is paused: after STALLED_PERIODS of them in which the
            answer's queue did not shrink, abort (a close would wait to flush what the client never reads)."""
            self._write_timer = None
            if self.transport.is_closing() or not self.flow.write_paused:
                return
            left = unsent_bytes(self.transport)
            self._write_stalled = 0 if self._write_left is None or left < self._write_left else self._write_stalled + 1
            self._write_left = left
            if self._write_stalled >= STALLED_PERIODS:
                self._close_then_abort(left)
                return
            self._write_timer = self.loop.call_later(self.timeout_keep_alive, self._write_check)

        def _close_then_abort(self, left: int) -> None:
            """Close (what was queued still goes out to a client that reads again), and abort if the queue
            then does not shrink for ``ABORT_PERIODS`` keep-alive timeouts: a close waits for ever to flush."""
            if not self.transport.is_closing():
                with contextlib.suppress(h11.LocalProtocolError):
                    self.conn.send(h11.ConnectionClosed())
                self.transport.close()
            self.loop.call_later(self.timeout_keep_alive * ABORT_PERIODS, self._abort_if_stuck, left)

        def _abort_if_stuck(self, left: int) -> None:
            if self._lost:
                return
            now = unsent_bytes(self.transport)
            if now and now < left:
                self.loop.call_later(self.timeout_keep_alive * ABORT_PERIODS, self._abort_if_stuck, now)
            else:
                self.transport.abort()

        def timeout_keep_alive_handler(self) -> None:
            # idle only once the last answer has left (see the module's docstring): while the send queue
            # drains, wait another keep-alive period; after STALLED_PERIODS of them without progress (a flow
            # can starve for a while behind others on a full link), close as uvicorn does
            left = unsent_bytes(self.transport)
            if self._unsent_before is None or left < self._unsent_before:
                self._stalled = 0
            else:
                self._stalled += 1
            if left and self._stalled < STALLED_PERIODS and not self.transport.is_closing():
                self._unsent_before = left
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)
                return
            self._unsent_before = None
            if left:
                self._close_then_abort(left)
            else:
                super().timeout_keep_alive_handler()

        def handle_websocket_upgrade(self, event: h11.Request) -> None:
            # the WebSocket protocol object takes the connection over, and its count with it. Every HTTP timer
            # ends here: h11 still thinks the upgrade request's body is on its way (uvicorn hands over before
            # its end), and a body check firing later wrote a 408 into the WebSocket's frames and closed it
            self._upgraded = True
            self._disarm_header_timer()
            for timer in (self._body_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            self._body_timer = self._write_timer = None
            address, self._counted = self._counted, None
            super().handle_websocket_upgrade(event)
            if address is not None:
                counts.give(address)

        def connection_lost(self, exc: Exception | None) -> None:
            self._lost = True
            self._disarm_header_timer()
            for timer in (self._body_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            self._body_timer = self._write_timer = None
            if self._counted is not None:
                counts.give(self._counted)
                self._counted = None
            super().connection_lost(exc)

    class GuardedWebSocket(ws_base):  # type: ignore[misc, valid-type]
        _counted: str | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            # called by GuardedHTTP.handle_websocket_upgrade, after it has freed its own count; taking it
            # again here cannot be refused by more than the connection just freed
            address = _address(transport)
            if counts.take(address, limits.per_client + 1):
                self._counted = address
            super().connection_made(transport)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._counted is not None:
                counts.give(self._counted)
                self._counted = None
            super().connection_lost(exc)

    return GuardedHTTP, GuardedWebSocket


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes (by its Content-Length, or as it streams) is
    answered 413 before the route sees it, except on routes with a limit of their own."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].startswith(OWN_LIMIT_PREFIXES):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            await self._too_large(send)
            return
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # raised inside the route's reading of its body: the framework's one mapping of
                    # HTTP errors answers it (413 → RequestTooLarge's code), not this middleware
                    from starlette.exceptions import HTTPException
                    raise HTTPException(status_code=413, detail=self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"request body over {self.limit} bytes, this agent's limit for it"

    async def _too_large(self, send: Any) -> None:
        exc = RequestTooLarge(self._message())
        body = json.dumps(exc.to_wire()).encode()
        await send({"type": "http.response.start", "status": exc.http_status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
