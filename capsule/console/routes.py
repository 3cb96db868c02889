"""The live console: a capsule's screen in the page, through the agent.

    POST /api/capsules/{name}/console-ticket    a ticket for that one capsule's screen (session + CSRF);
                                                ``?kind=serial`` for its serial console
    WS   /api/console/{name}?ticket=T           the screen's VNC byte stream, in binary WebSocket frames
    WS   /api/console/{name}/serial?ticket=T    the serial console: first the tail of its log, then the
                                                pty's output; what the page sends is typed into it
    GET  /api/capsules/{name}/clipboard         the guest's clipboard text (``clipboard.get``)
    PUT  /api/capsules/{name}/clipboard {text}  make a text the guest's clipboard (``clipboard.set``)
    PUT  /api/capsules/{name}/screen-size {width, height}   the guest's screen resolution (``screensize.set_size``)

QEMU's VNC server listens on a unix socket in the instance's directory only (``capsule.console.screen``); the agent
splices an authenticated WebSocket to it, so the page's noVNC speaks RFB to the guest's screen. The WebSocket
needs both the caller's session (cookie, or the host's token as a bearer token) and a ticket: a random string
that opens the console of the one capsule it was asked for, once, within ``TICKET_LIFETIME`` seconds, for the
session that asked for it. A browser sends no CSRF header on a WebSocket handshake; the ticket, which only a
script of this page can ask for (a CSRF-checked POST), stands in for it. Refusals happen at the handshake:
401 without a session, 403 for a missing, expired, reused or other capsule's ticket or another site's page.

A peer's consoles are relayed through this agent (``relay.py``). Installed by :func:`install` (one line in
``dashboard.install``), before the API's catch-all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
import time
import tty
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request, Response, WebSocket
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.websockets import WebSocketState

from capsule import privsep
from capsule.agent.sessions import Caller, Sessions
from capsule.agent.workers import workers_of
from capsule.console import clipboard, screen, screensize
from capsule.errors import Error
from capsule.store import Store

TICKET_LIFETIME = 30.0
MAX_TICKETS = 1024
CHUNK = 64 * 1024
# the page's browser libraries, installed by `npm ci` in web/ (web/package.json pins the versions,
# package-lock.json the bytes); CAPSULE_NODE_MODULES points elsewhere (an installed copy)
NODE_MODULES = Path(os.environ.get("CAPSULE_NODE_MODULES",
                                   Path(__file__).resolve().parents[2] / "web" / "node_modules"))
VENDOR = {"novnc": "@novnc/novnc", "xterm": "@xterm/xterm"}   # /web/vendor/NAME/ → node_modules/PACKAGE/


Kind = Literal["screen", "serial"]
HISTORY = 16 * 1024     # how much of the serial console's log a new serial connection is shown first


@dataclass
class Ticket:
    name: str
    kind: Kind
    sid: str | None      # the session that asked for it; None: a script with the bearer token
    expires: float


class Tickets:
    """Console tickets of one agent, in memory. ``clock`` is replaceable (tests)."""

    def __init__(self, lifetime: float = TICKET_LIFETIME, clock: Callable[[], float] = time.monotonic) -> None:
        self.lifetime = lifetime
        self.clock = clock
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, Ticket] = OrderedDict()

    def issue(self, name: str, sid: str | None, kind: Kind = "screen") -> str:
        ticket = secrets.token_urlsafe(32)
        with self._lock:
            self._by_id[ticket] = Ticket(name, kind, sid, self.clock() + self.lifetime)
            while len(self._by_id) > MAX_TICKETS:
                self._by_id.popitem(last=False)
        return ticket

    def redeem(self, ticket: str, name: str, sid: str | None, kind: Kind = "screen") -> bool:
        """True when ``ticket`` opens ``name``'s console of this kind for this session now. A ticket is used up
        by any attempt."""
        with self._lock:
            t = self._by_id.pop(ticket, None)
        return (t is not None and t.name == name and t.kind == kind and t.sid == sid
                and self.clock() < t.expires)


class ClipboardIn(BaseModel):
    text: str


class ClipboardOut(BaseModel):
    text: str
    bytes: int        # of UTF-8
    max_bytes: int    # the clipboard's limit, either way


class ClipboardSet(BaseModel):
    bytes: int
    max_bytes: int


class ScreenSize(BaseModel):
    width: int
    height: int


class TicketOut(BaseModel):
    ticket: str
    expires_in: float
    url: str          # the WebSocket's path and query, on this agent


def install(app: FastAPI, store: Store, sessions: Sessions, tickets: Tickets | None = None) -> Tickets:
    from capsule.console import relay

    tickets = tickets or Tickets()
    app.state.console_tickets = tickets
    app.include_router(router(store, sessions, tickets))
    app.include_router(relay.router(store, sessions, tickets, signed_in(sessions)))
    for name, package in VENDOR.items():  # before the page's own /web mount, which would answer 404 for them
        if (NODE_MODULES / package).is_dir():
            app.mount(f"/web/vendor/{name}", StaticFiles(directory=NODE_MODULES / package), name=name)
    return tickets


def signed_in(sessions: Sessions) -> Callable[[Request, Response], Caller]:
    """The dependency of a console's HTTP calls: a session + CSRF, or the bearer token (``request.state.caller``)."""
    def caller(request: Request, response: Response) -> Caller:
        response.headers["Cache-Control"] = "no-store"
        request.state.caller = sessions.authenticate(request)
        return request.state.caller

    return caller


def router(store: Store, sessions: Sessions, tickets: Tickets) -> APIRouter:
    caller = signed_in(sessions)
    api = APIRouter(prefix="/api", tags=["dashboard"])

    @api.post("/capsules/{name}/console-ticket", response_model=TicketOut, dependencies=[Depends(caller)],
              summary="A short-lived, single-use ticket for one running capsule's console")
    async def console_ticket(name: str, request: Request, kind: Kind = "screen") -> TicketOut:
        c: Caller = request.state.caller
        # NotFound / Conflict before any ticket
        await asyncio.to_thread(screen.vnc_socket if kind == "screen" else screen.serial_console, store, name)
        ticket = tickets.issue(name, None if c.session is None else c.session.sid, kind)
        path = f"/api/console/{name}" + ("/serial" if kind == "serial" else "")
        return TicketOut(ticket=ticket, expires_in=tickets.lifetime, url=f"{path}?ticket={ticket}")

    @api.get("/capsules/{name}/clipboard", response_model=ClipboardOut, dependencies=[Depends(caller)],
             summary="The running capsule's clipboard text, through its guest agent")
    async def clipboard_get(name: str, request: Request) -> ClipboardOut:
        text = await workers_of(request).act(request, clipboard.get, store, name)
        return ClipboardOut(text=text, bytes=len(text.encode()), max_bytes=clipboard.MAX_BYTES)

    @api.put("/capsules/{name}/clipboard", response_model=ClipboardSet, dependencies=[Depends(caller)],
             summary="Make a text the running capsule's clipboard, through its guest agent")
    async def clipboard_set(name: str, body: ClipboardIn, request: Request) -> ClipboardSet:
        size = await workers_of(request).act(request, clipboard.set, store, name, body.text)
        return ClipboardSet(bytes=size, max_bytes=clipboard.MAX_BYTES)

    @api.put("/capsules/{name}/screen-size", response_model=ScreenSize, dependencies=[Depends(caller)],
             summary="Set the running capsule's screen resolution, through its guest agent")
    async def screen_size(name: str, body: ScreenSize, request: Request) -> ScreenSize:
        w, h = await workers_of(request).act(request, screensize.set_size, store, name, body.width, body.height)
        return ScreenSize(width=w, height=h)

    @api.websocket("/console/{name}/serial")
    async def serial(ws: WebSocket, name: str, ticket: str = "") -> None:
        if not await admit(sessions, tickets, ws, name, ticket, "serial"):
            return
        try:
            console = await asyncio.to_thread(screen.serial_console, store, name)
            # through the root helper when this agent is not root: QEMU's user owns the pty (mode 0620)
            fd = await asyncio.to_thread(privsep.current().open_serial, store.domain_name(name), console.pty)
            reader, writer, close = await open_pty(fd)
        except Error as exc:
            await deny(ws, exc.http_status, str(exc))
            return
        except OSError as exc:
            await deny(ws, 409, f"the serial console of {name!r} does not answer ({exc.strerror})")
            return
        try:
            await ws.accept()
            await ws.send_bytes(await asyncio.to_thread(log_tail, console.log, HISTORY))
            await splice(ws, reader, writer, text=True)
        finally:
            close()

    @api.websocket("/console/{name}")
    async def console(ws: WebSocket, name: str, ticket: str = "") -> None:
        if not await admit(sessions, tickets, ws, name, ticket, "screen"):
            return
        try:
            sock = await asyncio.to_thread(screen.connect_screen, store, name)
            reader, writer = await asyncio.open_unix_connection(sock=sock)
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


async def admit(sessions: Sessions, tickets: Tickets, ws: WebSocket, key: str, ticket: str, kind: Kind) -> bool:
    """Check a console WebSocket's handshake: a session (or the bearer token), this site's page, and a ticket
    for ``key`` (a capsule here, or ``host/capsule``) of this kind; refuse it (401/403) otherwise."""
    c = ws_caller(sessions, ws)
    if c is None:
        await deny(ws, 401, "sign in first")
        return False
    if not same_origin(ws):
        await deny(ws, 403, "cross-site request refused")
        return False
    if not tickets.redeem(ticket, key, None if c.session is None else c.session.sid, kind):
        await deny(ws, 403, f"no valid {kind} console ticket for this capsule (ask for one: they last "
                            f"{tickets.lifetime:.0f} s and open one console once)")
        return False
    return True


def ws_caller(sessions: Sessions, ws: WebSocket) -> Caller | None:
    """Who the guard (:mod:`capsule.agent.authz`) found the handshake to come from (a session or a bearer token,
    allowed this capsule's console); None when neither."""
    return ws.scope.get("state", {}).get("caller")


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


def log_tail(log: Path, size: int) -> bytes:
    """The last ``size`` bytes of the console log, from a line start when there is one."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            data = f.read(size)
    except FileNotFoundError:
        return b""
    cut = data.find(b"\n")
    return data[cut + 1:] if len(data) == size and cut >= 0 else data


async def open_pty(fd: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Callable[[], None]]:
    """asyncio streams on the guest's pty ``fd`` (put in raw mode; opened as ``guestfiles.open_pty`` checks it), and
    a function that closes both. The descriptor is theirs."""
    loop = asyncio.get_running_loop()
    try:
        tty.setraw(fd)
        wfd = os.dup(fd)
    except OSError:
        os.close(fd)
        raise
    reader = asyncio.StreamReader()
    rtransport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                 os.fdopen(fd, "rb", buffering=0))
    wtransport, wprotocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                          os.fdopen(wfd, "wb", buffering=0))
    writer = asyncio.StreamWriter(wtransport, wprotocol, None, loop)

    def close() -> None:
        rtransport.close()
        wtransport.close()

    return reader, writer, close


async def splice(ws: WebSocket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 text: bool = False) -> None:
    """Copy bytes both ways until either side ends, then close both ends. Binary frames from the page;
    ``text``: text frames too (typed keys, as UTF-8)."""

    async def upstream(scope: anyio.CancelScope) -> None:       # the page → the VNC server / the pty
        with contextlib.suppress(OSError):
            while True:
                msg = await ws.receive()
                if msg["type"] != "websocket.receive":
                    break
                data = msg.get("bytes")
                if data is None and text and msg.get("text") is not None:
                    data = msg["text"].encode()
                if data is None:        # a text frame, which RFB never sends
                    break
                writer.write(data)
                await writer.drain()
        scope.cancel()

    async def downstream(scope: anyio.CancelScope) -> None:     # the VNC server / the pty → the page
        with contextlib.suppress(OSError):   # a pty whose other side is gone reads EIO
            while data := await reader.read(CHUNK):
                await ws.send_bytes(data)
        scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(upstream, tg.cancel_scope)
            tg.start_soon(downstream, tg.cancel_scope)
    finally:
        writer.close()
        with anyio.CancelScope(shield=True), contextlib.suppress(OSError, NotImplementedError):
            await writer.wait_closed()
        if ws.client_state == WebSocketState.CONNECTED and ws.application_state == WebSocketState.CONNECTED:
            with anyio.CancelScope(shield=True), contextlib.suppress(RuntimeError, OSError):
                await ws.close(1000)
