"""A peer's console through this agent: the page signs in here only, and still sees a capsule's console after it
moved to another host (the migrate dialog's "the console follows it").

    POST /api/hosts/{host}/capsules/{name}/console-ticket[?kind=serial]   a ticket of this agent for that
                                                                          console (session + CSRF)
    WS   /api/hosts/{host}/console/{name}[/serial]?ticket=T               that console, relayed
    GET  /api/hosts/{host}/capsules/{name}/clipboard                      its clipboard, asked of the peer
    PUT  /api/hosts/{host}/capsules/{name}/clipboard {text}               set there (``peerclip.py``)
    PUT  /api/hosts/{host}/capsules/{name}/screen-size {width, height}    its screen's resolution, set there

The WebSocket is checked here as any console's (session, origin, this agent's ticket for ``host/name``); then this
agent asks the peer for a ticket with the peer's token (``capsule host add`` keeps it), opens the peer's console
WebSocket with it and relays frames both ways. The browser never holds the peer's token or a session there."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import anyio
from fastapi import APIRouter, Depends, Request, WebSocket
from starlette.websockets import WebSocketState
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from capsule import hosts
from capsule.agent.sessions import Caller, Sessions
from capsule.agentclient import AgentClient
from capsule.console import peerclip
from capsule.console.routes import (
    ClipboardIn,
    ClipboardOut,
    ClipboardSet,
    Kind,
    ScreenSize,
    TicketOut,
    Tickets,
    admit,
    deny,
)
from capsule.errors import Error
from capsule.names import check_name
from capsule.store import Store
from hashcache.transport import tls

PEER_TIMEOUT = 10.0


def router(store: Store, sessions: Sessions, tickets: Tickets, caller: Callable[..., Caller]) -> APIRouter:
    api = APIRouter(prefix="/api/hosts", tags=["dashboard"])

    @api.post("/{host}/capsules/{name}/console-ticket", response_model=TicketOut, dependencies=[Depends(caller)],
              summary="A ticket for a peer's capsule's console, relayed through this agent")
    async def peer_ticket(host: str, name: str, request: Request, kind: Kind = "screen") -> TicketOut:
        c: Caller = request.state.caller
        await asyncio.to_thread(hosts.get, store, host)     # NotFound for an unknown host
        check_name(name)
        ticket = tickets.issue(f"{host}/{name}", None if c.session is None else c.session.sid, kind)
        path = f"/api/hosts/{host}/console/{name}" + ("/serial" if kind == "serial" else "")
        return TicketOut(ticket=ticket, expires_in=tickets.lifetime, url=f"{path}?ticket={ticket}")

    @api.get("/{host}/capsules/{name}/clipboard", response_model=ClipboardOut, dependencies=[Depends(caller)],
             summary="A peer's capsule's clipboard text, asked of the peer through this agent")
    async def peer_clipboard(host: str, name: str) -> dict:
        return await asyncio.to_thread(peerclip.get, store, host, name)

    @api.put("/{host}/capsules/{name}/clipboard", response_model=ClipboardSet, dependencies=[Depends(caller)],
             summary="Make a text a peer's capsule's clipboard, through this agent")
    async def peer_clipboard_set(host: str, name: str, body: ClipboardIn) -> dict:
        return await asyncio.to_thread(peerclip.set, store, host, name, body.text)

    @api.put("/{host}/capsules/{name}/screen-size", response_model=ScreenSize, dependencies=[Depends(caller)],
             summary="Set a peer's capsule's screen resolution, through this agent")
    async def peer_screen_size(host: str, name: str, body: ScreenSize) -> ScreenSize:
        w, h = await asyncio.to_thread(peerclip.set_size, store, host, name, body.width, body.height)
        return ScreenSize(width=w, height=h)

    async def relayed(ws: WebSocket, host: str, name: str, ticket: str, kind: Kind) -> None:
        if not await admit(sessions, tickets, ws, f"{host}/{name}", ticket, kind):
            return
        try:
            peer = await asyncio.to_thread(hosts.get, store, host)
            grant = await asyncio.to_thread(_peer_ticket, peer, name, kind)
            url = _ws_url(peer.url, grant["url"])
            upstream = await connect(url, additional_headers={"Authorization": f"Bearer {peer.token}"},
                                     subprotocols=["binary"] if kind == "screen" else None,  # type: ignore[list-item]
                                     max_size=None, open_timeout=PEER_TIMEOUT,
                                     ssl=tls.client_context(peer.fingerprint) if url.startswith("wss://") else None)
        except Error as exc:
            await deny(ws, exc.http_status, f"host {host}: {exc}")
            return
        except InvalidStatus as exc:
            await deny(ws, 502, f"host {host} refused its console ({exc.response.status_code})")
            return
        except (OSError, TimeoutError, WebSocketException, KeyError, TypeError) as exc:
            if bad := tls.cause(exc):
                await deny(ws, 502, f"host {host}: {tls.explain(peer.url, bad)}")
                return
            await deny(ws, 502, f"host {host} does not answer for its console ({type(exc).__name__}: {exc})")
            return
        offered = ws.scope.get("subprotocols") or []
        await ws.accept(subprotocol="binary" if "binary" in offered else None)
        await relay(ws, upstream)

    @api.websocket("/{host}/console/{name}")
    async def screen(ws: WebSocket, host: str, name: str, ticket: str = "") -> None:
        await relayed(ws, host, name, ticket, "screen")

    @api.websocket("/{host}/console/{name}/serial")
    async def serial(ws: WebSocket, host: str, name: str, ticket: str = "") -> None:
        await relayed(ws, host, name, ticket, "serial")

    return api


def _peer_ticket(peer: hosts.Peer, name: str, kind: Kind) -> dict:
    with AgentClient(peer.url, peer.token, timeout=PEER_TIMEOUT, fingerprint=peer.fingerprint) as client:
        return client.request("POST", f"/api/capsules/{name}/console-ticket", params={"kind": kind},
                              json_body={}, idempotent=False).json()


def _ws_url(base: str, path: str) -> str:
    if not path.startswith("/api/console/"):
        raise TypeError(f"unexpected console URL {path[:120]!r}")
    u = urlsplit(base)
    p = urlsplit(path)
    return urlunsplit(("wss" if u.scheme == "https" else "ws", u.netloc, p.path, p.query, ""))


async def relay(ws: WebSocket, upstream: ClientConnection) -> None:
    """Frames both ways between the page and the peer until either ends; then both are closed."""

    async def up(scope: anyio.CancelScope) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                msg = await ws.receive()
                if msg["type"] != "websocket.receive":
                    break
                data = msg.get("bytes")
                await upstream.send(data if data is not None else msg.get("text") or "")
        scope.cancel()

    async def down(scope: anyio.CancelScope) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in upstream:
                if isinstance(frame, bytes):
                    await ws.send_bytes(frame)
                else:
                    await ws.send_text(frame)
        scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(up, tg.cancel_scope)
            tg.start_soon(down, tg.cancel_scope)
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await upstream.close()
        if ws.client_state == WebSocketState.CONNECTED and ws.application_state == WebSocketState.CONNECTED:
            with anyio.CancelScope(shield=True), contextlib.suppress(RuntimeError, OSError):
                await ws.close(1000)
