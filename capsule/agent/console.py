"""The live console: a capsule's screen in the page, through the agent.

    POST /api/capsules/{name}/console-ticket    a ticket for that one capsule's screen (session + CSRF)
    WS   /api/console/{name}?ticket=T           the screen's VNC byte stream, in binary WebSocket frames

QEMU's VNC server listens on a unix socket in the instance's directory only (``capsule.screen``); the agent
splices an authenticated WebSocket to it, so the page's noVNC speaks RFB to the guest's screen. The WebSocket
needs both the caller's session (cookie, or the host's token as a bearer token) and a ticket: a random string
that opens the console of the one capsule it was asked for, once, within ``TICKET_LIFETIME`` seconds, for the
session that asked for it. A browser sends no CSRF header on a WebSocket handshake; the ticket, which only a
script of this page can ask for (a CSRF-checked POST), stands in for it. Refusals happen at the handshake:
401 without a session, 403 for a missing, expired, reused or other capsule's ticket or another site's page.

Installed by :func:`install` (one line in ``dashboard.install``), before the API's catch-all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request, Response, WebSocket
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.websockets import WebSocketState

from capsule import screen
from capsule.agent.sessions import Caller, Sessions
from capsule.errors import Error
from capsule.store import Store

TICKET_LIFETIME = 30.0
MAX_TICKETS = 1024
CHUNK = 64 * 1024
# noVNC's ES modules, installed by `npm ci` in web/ (web/package.json pins the version, package-lock.json the bytes)
NOVNC_DIR = Path(os.environ.get("CAPSULE_NOVNC_DIR", Path(__file__).resolve().parents[2] / "web" / "node_modules"
                                / "@novnc" / "novnc"))


@dataclass
class Ticket:
    name: str
    sid: str | None      # the session that asked for it; None: a script with the bearer token
    expires: float


class Tickets:
    """Console tickets of one agent, in memory. ``clock`` is replaceable (tests)."""

    def __init__(self, lifetime: float = TICKET_LIFETIME, clock: Callable[[], float] = time.monotonic) -> None:
        self.lifetime = lifetime
        self.clock = clock
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, Ticket] = OrderedDict()

    def issue(self, name: str, sid: str | None) -> str:
        ticket = secrets.token_urlsafe(32)
        with self._lock:
            self._by_id[ticket] = Ticket(name, sid, self.clock() + self.lifetime)
            while len(self._by_id) > MAX_TICKETS:
                self._by_id.popitem(last=False)
        return ticket

    def redeem(self, ticket: str, name: str, sid: str | None) -> bool:
        """True when ``ticket`` opens ``name`` for this session now. A ticket is used up by any attempt."""
        with self._lock:
            t = self._by_id.pop(ticket, None)
        return t is not None and t.name == name and t.sid == sid and self.clock() < t.expires


class TicketOut(BaseModel):
    ticket: str
    expires_in: float
    url: str          # the WebSocket's path and query, on this agent


def install(app: FastAPI, store: Store, sessions: Sessions, tickets: Tickets | None = None) -> Tickets:
    tickets = tickets or Tickets()
    app.state.console_tickets = tickets
    app.include_router(router(store, sessions, tickets))
    if NOVNC_DIR.is_dir():   # before the page's own /web mount, which would answer 404 for it
        app.mount("/web/vendor/novnc", StaticFiles(directory=NOVNC_DIR), name="novnc")
    return tickets


def router(store: Store, sessions: Sessions, tickets: Tickets) -> APIRouter:
    def caller(request: Request, response: Response) -> Caller:
        response.headers["Cache-Control"] = "no-store"
        request.state.caller = sessions.authenticate(request)
        return request.state.caller

    api = APIRouter(prefix="/api", tags=["dashboard"])

    @api.post("/capsules/{name}/console-ticket", response_model=TicketOut, dependencies=[Depends(caller)],
              summary="A short-lived, single-use ticket for one running capsule's console")
    async def console_ticket(name: str, request: Request) -> TicketOut:
        c: Caller = request.state.caller
        await asyncio.to_thread(screen.vnc_socket, store, name)   # NotFound / Conflict before any ticket
        ticket = tickets.issue(name, None if c.session is None else c.session.sid)
        return TicketOut(ticket=ticket, expires_in=tickets.lifetime, url=f"/api/console/{name}?ticket={ticket}")

    @api.websocket("/console/{name}")
    async def console(ws: WebSocket, name: str, ticket: str = "") -> None:
        c = ws_caller(sessions, ws)
        if c is None:
            await deny(ws, 401, "sign in first")
            return
        if not same_origin(ws):
            await deny(ws, 403, "cross-site request refused")
            return
        if not tickets.redeem(ticket, name, None if c.session is None else c.session.sid):
            await deny(ws, 403, "no valid console ticket for this capsule (ask for one: they last "
                                f"{tickets.lifetime:.0f} s and open one console once)")
            return
        try:
            sock = await asyncio.to_thread(screen.vnc_socket, store, name)
            reader, writer = await asyncio.open_unix_connection(str(sock))
        except Error as exc:
            await deny(ws, exc.http_status, str(exc))
            return
        except OSError as exc:
            await deny(ws, 409, f"the screen of {name!r} does not answer ({exc.strerror})")
            return
        offered = ws.scope.get("subprotocols") or []
        await ws.accept(subprotocol="binary" if "binary" in offered else None)
        await splice(ws, reader, writer)

    return api


def ws_caller(sessions: Sessions, ws: WebSocket) -> Caller | None:
    """The bearer token or a live session, like every API call; None when neither."""
    auth = ws.headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        return Caller(None) if scheme == "Bearer" and sessions.check_token(token) else None
    session = sessions.lookup(ws.cookies.get(sessions.cookie))
    return None if session is None else Caller(session)


def same_origin(ws: WebSocket) -> bool:
    origin = ws.headers.get("origin")
    if origin is None:
        return True          # not a browser
    scheme = "https" if ws.url.scheme == "wss" else "http"
    return origin == f"{scheme}://{ws.headers.get('host', '')}"


async def deny(ws: WebSocket, status: int, detail: str) -> None:
    """Refuse the handshake with an HTTP status (not a WebSocket close), so the caller sees 401 or 403."""
    await ws.send_denial_response(Response(content=detail, status_code=status, media_type="text/plain",
                                           headers={"Cache-Control": "no-store"}))


async def splice(ws: WebSocket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes both ways until either side ends, then close both ends."""

    async def upstream(scope: anyio.CancelScope) -> None:       # the page → the VNC server
        while True:
            msg = await ws.receive()
            data = msg.get("bytes") if msg["type"] == "websocket.receive" else None
            if data is None:            # the page left; or a text frame, which RFB never sends
                break
            writer.write(data)
            await writer.drain()
        scope.cancel()

    async def downstream(scope: anyio.CancelScope) -> None:     # the VNC server → the page
        while data := await reader.read(CHUNK):
            await ws.send_bytes(data)
        scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(upstream, tg.cancel_scope)
            tg.start_soon(downstream, tg.cancel_scope)
    finally:
        writer.close()
        with anyio.CancelScope(shield=True), contextlib.suppress(OSError):
            await writer.wait_closed()
        if ws.client_state == WebSocketState.CONNECTED and ws.application_state == WebSocketState.CONNECTED:
            with anyio.CancelScope(shield=True), contextlib.suppress(RuntimeError, OSError):
                await ws.close(1000)
