"""The agent's side of protocol versions (:mod:`hashcache.transport.protocol`): every answer names this
agent's protocol and release; a Capsule client more than one release older is refused before anything else,
with a message naming both sides; the peer a request came from is kept for the routes whose answer depends
on it (``scope["state"]["peer"]``: None for a client that is not Capsule, a browser or a script). Every answer
also names what this agent serves beyond its protocol (:data:`FEATURES`, see :func:`protocol.features_of`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from capsule import __version__
from hashcache.errors import ProtocolMismatch
from hashcache.transport import protocol

Scope = MutableMapping[str, Any]
ASGI = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]
# beyond the protocol: the byte tunnel (capsule/exchange/tunnel.py), receiving live moves
# (capsule/exchange/incoming.py), the tunnel's memory codec (capsule/migrate/ramdedup.py) with its runs of
# blocks by place, manifest parts compressed against a like file held here (hashcache.hcp.like_records), and a
# tunnel channel's bytes packed with zstd (capsule/migrate/streampack.py), blocks of the kernel as it
# unpacks itself (capsule/migrate/kernelimage.py), and pages as deltas against them (capsule/migrate/memdelta.py)
FEATURES = ("tunnel", "live-move", "memory-dedup", "memory-runs", "manifest-like", "tunnel-pack", "memory-kernel",
            "memory-delta")
ANSWER = (protocol.HEADER.lower().encode(), protocol.answer(__version__).encode())
NAMED = (protocol.FEATURES.lower().encode(), ",".join(FEATURES).encode())


def peer_of(conn: Request | WebSocket) -> protocol.Peer | None:
    return conn.scope.get("state", {}).get("peer")


class Versions:
    """ASGI middleware: the protocol header on every answer; too old a Capsule client refused."""

    def __init__(self, app: ASGI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        agent = dict((k.lower(), v) for k, v in scope.get("headers", [])).get(b"user-agent", b"")
        peer = protocol.of_client(agent.decode("latin-1"))
        scope.setdefault("state", {})["peer"] = peer
        try:
            if peer is not None:
                protocol.check(peer, __version__, "the caller")
        except ProtocolMismatch as exc:
            reply = JSONResponse(exc.to_wire(), status_code=exc.http_status, headers=dict([_header()]))
            if scope["type"] == "websocket":
                ws = WebSocket(scope, receive, send)
                if "websocket.http.response" in scope.get("extensions", {}):
                    await ws.send_denial_response(reply)
                else:
                    await ws.close(code=1002)
            else:
                await reply(scope, receive, send)
            return

        async def named(message: Any) -> None:
            if message["type"] in ("http.response.start", "websocket.http.response.start", "websocket.accept"):
                message.setdefault("headers", []).extend((ANSWER, NAMED))
            await send(message)

        await self.app(scope, receive, named)


def _header() -> tuple[str, str]:
    return protocol.HEADER, protocol.answer(__version__)
