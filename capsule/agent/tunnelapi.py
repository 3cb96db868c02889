"""The agent's routes of the byte tunnel (what they do, who may call them, the frames: :mod:`capsule.exchange.tunnel`)::

    POST   /v1/tunnel                      {"kinds": [KIND, ...], "ttl": S, "dedup": ..., "pack": [KIND, ...]}
                                           → {"session", "expires_in", "channels", "dedup", "pack"}
    WS     /v1/tunnel/{session}/{channel}  one connection to the channel's unix socket here, bytes both ways
    DELETE /v1/tunnel/{session}            the session and its connections end"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import anyio
from fastapi import APIRouter, Request, WebSocket
from starlette.responses import JSONResponse
from starlette.websockets import WebSocketState

from capsule.agent import authz
from capsule.errors import Error, Forbidden, InvalidName
from capsule.exchange.tunnel import Registry, connect_target, parse_dedup, parse_open, parse_pack, pump
from hashcache import wirejson


async def _deny(ws: WebSocket, exc: Error) -> None:
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse(exc.to_wire(), status_code=exc.http_status))
    else:
        await ws.close(code=1008)


def _who(conn: Request | WebSocket) -> str:
    c = authz.caller_of(conn)
    if c is None:                                   # (the guard refused it already: this never happens)
        raise Forbidden("a tunnel needs a host call's token")
    return c.principal.who


def router(registry: Registry) -> APIRouter:
    api = APIRouter(prefix="/v1/tunnel", tags=["tunnel"])

    @api.post("", summary="Open a tunnel session: channels by kind, paths chosen by this host")
    async def open_tunnel(request: Request) -> dict[str, Any]:
        try:
            req = wirejson.loads(await request.body())
        except ValueError as exc:
            raise InvalidName(f"malformed tunnel request: {exc}") from exc
        kinds, ttl = parse_open(req)
        s = await asyncio.to_thread(registry.open_kinds, kinds, _who(request), ttl, parse_dedup(req),
                                    parse_pack(req))
        return s.answer(time.monotonic())

    @api.delete("/{session}", summary="Close a tunnel session and its connections")
    async def close_tunnel(session: str, request: Request) -> dict[str, Any]:
        await asyncio.to_thread(registry.close_session, session, _who(request))
        return {"closed": session}

    @api.websocket("/{session}/{channel}")
    async def carry(ws: WebSocket, session: str, channel: str) -> None:
        try:
            s = registry.get(session, _who(ws))
            with registry.connection(s, channel) as target:
                decoder = registry.decoder(s, channel)
                reader, writer = await connect_target(target)
                stop = (asyncio.get_running_loop(), anyio.CancelScope())
                s.stops.add(stop)
                if not registry.live(s):        # closed while QEMU was awaited
                    stop[1].cancel()
                try:
                    with stop[1]:
                        await ws.accept()
                        await pump(ws, reader, writer, decoder, s.errors)
                finally:
                    s.stops.discard(stop)
                    writer.close()
                if stop[1].cancel_called and ws.application_state == WebSocketState.CONNECTED:
                    with contextlib.suppress(RuntimeError, OSError):     # the session was closed under it
                        await ws.close(1001, "tunnel session closed")
        except Error as exc:
            if ws.application_state == WebSocketState.CONNECTING:
                await _deny(ws, exc)

    return api
