"""The destination side of the byte tunnel a live move uses (the source side is :mod:`capsule.migrate.tunnel`).

Hosts reach each other only through their agents, but a live move needs three streams between the hosts: the
source libvirtd to the destination libvirtd, the source QEMU to the destination QEMU's migration stream and to
its NBD disk server. Each is carried over one WebSocket on this agent per connection (the routes are
:mod:`capsule.agent.tunnelapi`, thin shells over :class:`Registry` and :func:`pump`)::

    POST   /v1/tunnel                      {"kinds": ["libvirt", "qemu-migration", "qemu-disks"], "ttl": S,
                                            "dedup": {"objects": [[KIND, ID], ...]},   (dedup: optional)
                                            "pack": ["qemu-disks"]}                    (pack: optional)
                                           → {"session": ID, "expires_in": S, "channels": {KIND: {"path": P}},
                                              "dedup": true|false, "pack": [KIND, ...]}
    WS     /v1/tunnel/{session}/{channel}  binary frames both ways, to and from the channel's unix socket here
    DELETE /v1/tunnel/{session}            the session ends: its connections are closed, its directory removed

The caller names channels by KIND, never by path; this host chooses every target:

- ``libvirt``: this host's libvirtd socket (``/run/libvirt/libvirt-sock``; ``CAPSULE_LIBVIRT_SOCKET`` on hosts
  or tests where it is elsewhere). Its answer has ``"path": null``.
- ``qemu-migration``, ``qemu-disks``: a socket in a fresh directory of this session under the tunnel directory
  (``/run/capsule/tunnel``, ``CAPSULE_TUNNEL_DIR``), 01770 root:QEMU's group: the destination QEMU listens
  there (libvirt's ``--migrateuri unix://P`` / ``--disks-uri unix://P``). The answer names the path, so the
  source makes its tunnel's entrance at the same path (libvirt gives both QEMUs the same one). A connection that
  arrives before QEMU listens is retried for :data:`TARGET_WAIT` seconds; the socket must be the guest user's
  (:func:`capsule.runtime.guestfiles.connect_socket`).

Who may use it: the rule of ``/v1/tunnel`` (:mod:`capsule.agent.authz`) admits host calls of staff only — what
receiving a capsule here needs — and no grant; a session is then usable only by the token that opened it
(:class:`Forbidden` for another), unknown or expired sessions are :class:`NotFound`, and all of this is decided
before a byte reaches a target. Bounds: :data:`SESSIONS_PER_CALLER`, :data:`SESSIONS` in all,
:data:`CONNECTIONS_PER_CHANNEL`, a session's ``ttl`` within :data:`TTL` (after it no new connection is
admitted; those open go on until the session is deleted or either end closes).

``dedup`` (the memory codec, :mod:`capsule.migrate.ramdedup`): the source's bytes on the ``qemu-migration``
channel are the codec's frames, decoded here before QEMU reads them (references resolved through this host's
hash cache and the objects named, each page's BLAKE3 checked); the other direction and the other channels are
untouched. The answer says whether this host applies it (``"dedup": false``: send raw). A stream the decoder
refuses is cut (QEMU's incoming migration fails; the source's guest runs on) and the WebSocket closed with 1011
and the reason.

Frames: every binary message carries bytes as they came; an EMPTY binary message means "no more bytes this
way" (a half-close: the receiving end shuts its writing side, the other direction goes on). A connection ends
when both directions have ended, or at once when either end closes or fails. Text frames are refused (1003)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from capsule import bounds
from capsule.errors import EnvironmentProblem, Error, Forbidden, InvalidName, NotFound, Overloaded, Unreachable
from capsule.migrate.memknown import Objects
from capsule.migrate.memrefs import parse_objects
from capsule.migrate.ramdedup import Decoder, Resolve
from capsule.migrate.streampack import PACKABLE, Unpacker
from capsule.migrate.tunnel import CHUNK, DEDUP_KIND, DEFAULT_TTL, KINDS, QEMU_KINDS
from capsule.runtime import guestaccess, guestfiles

LIBVIRT_SOCKET = "/run/libvirt/libvirt-sock"
LIBVIRT_ENV = "CAPSULE_LIBVIRT_SOCKET"
TUNNEL_DIR = "/run/capsule/tunnel"
TUNNEL_DIR_ENV = "CAPSULE_TUNNEL_DIR"
SESSION_DIR_MODE = 0o1770          # QEMU makes its listening sockets here; the sticky bit: it removes only its own
TTL = bounds.Bound(10, 86400, integer=False, unit="seconds")
SESSIONS_PER_CALLER = 8
SESSIONS = 64
CONNECTIONS_PER_CHANNEL = 8
TARGET_WAIT = 10.0                 # seconds a connection waits for QEMU to listen on its socket


@dataclass(frozen=True)
class Target:
    """Where a channel's connections go: a unix socket path chosen here; ``guest``: QEMU's own socket (its owner
    is checked before connecting)."""

    path: Path
    guest: bool = False


@dataclass
class Session:
    id: str
    channels: dict[str, Target]
    caller: str                    # Principal.who of the token that opened it
    expires: float                 # time.monotonic() after which no new connection is admitted
    directory: Path | None = None  # its own directory under the tunnel directory (removed with it)
    open: Counter[str] = field(default_factory=Counter)   # connections open per channel
    stops: set[tuple[asyncio.AbstractEventLoop, anyio.CancelScope]] = field(default_factory=set)  # its connections
    dedup: Objects | None = None   # the memory codec on qemu-migration, references among these objects
    pack: frozenset[str] = frozenset()   # channels whose source bytes come packed (streampack.py)
    errors: list[str] = field(default_factory=list)        # why a decoded stream was cut (the latest few)

    def answer(self, now: float) -> dict[str, Any]:
        return {"session": self.id, "expires_in": round(max(0.0, self.expires - now), 1),
                "channels": {name: {"path": str(t.path) if t.guest else None} for name, t in self.channels.items()},
                "dedup": self.dedup is not None, "pack": sorted(self.pack)}


class Registry:
    """The tunnel sessions of one agent process (thread-safe: routes call it from the event loop and threads)."""

    def __init__(self, tunnel_dir: Path | None = None, libvirt_socket: Path | None = None,
                 resolver: Callable[[Objects], Resolve] | None = None) -> None:
        self.resolver = resolver          # how the memory codec reads blocks here (None: it is never applied)
        self.tunnel_dir = Path(tunnel_dir or os.environ.get(TUNNEL_DIR_ENV) or TUNNEL_DIR)
        self.libvirt_socket = Path(libvirt_socket or os.environ.get(LIBVIRT_ENV) or LIBVIRT_SOCKET)
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.on_end: list[Callable[[str], object]] = []   # called with a session's id once it ended (in a thread)

    def open_session(self, channels: Mapping[str, Path | Target], caller: str, ttl: float = DEFAULT_TTL,
                     directory: Path | None = None) -> Session:
        """A new session whose channels go to the targets given (this host's choice, never a caller's)."""
        ttl = float(bounds.check(TTL, ttl, "ttl"))
        targets = {name: t if isinstance(t, Target) else Target(Path(t)) for name, t in channels.items()}
        with self._lock:
            self._purge()
            if len(self._sessions) >= SESSIONS:
                raise Overloaded(f"this host has {SESSIONS} tunnel sessions open already; close some "
                                 "(DELETE /v1/tunnel/ID) or wait for them to expire")
            mine = sum(1 for s in self._sessions.values() if s.caller == caller)
            if mine >= SESSIONS_PER_CALLER:
                raise Overloaded(f"{caller} has {mine} tunnel sessions open here already (at most "
                                 f"{SESSIONS_PER_CALLER}); close one first (DELETE /v1/tunnel/ID)")
            s = Session(secrets.token_hex(16), targets, caller, time.monotonic() + ttl, directory)
            self._sessions[s.id] = s
        return s

    def open_kinds(self, kinds: list[str], caller: str, ttl: float = DEFAULT_TTL,
                   dedup: Objects | None = None, pack: list[str] | None = None) -> Session:
        """``POST /v1/tunnel``: a session with a channel per kind, each to the target this host picks for it;
        ``dedup``: the memory codec on its qemu-migration channel (applied if this host can resolve blocks);
        ``pack``: channels whose source bytes come packed (:mod:`capsule.migrate.streampack`)."""
        ttl = float(bounds.check(TTL, ttl, "ttl"))
        with self._lock:
            self._purge()
        directory = self._session_dir() if any(k in QEMU_KINDS for k in kinds) else None
        channels: dict[str, Target] = {}
        for kind in kinds:
            if kind == "libvirt":
                channels[kind] = Target(self.libvirt_socket)
            else:
                assert directory is not None
                channels[kind] = Target(directory / f"{kind}.sock", guest=True)
        try:
            s = self.open_session(channels, caller, ttl, directory)
        except BaseException:
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
            raise
        if dedup is not None and self.resolver is not None and DEDUP_KIND in kinds:
            s.dedup = dedup
        s.pack = frozenset(k for k in pack or () if k in kinds and k in PACKABLE)
        return s

    def decoder(self, s: Session, channel: str) -> Decoder | Unpacker | None:
        """The decoder for a new connection of ``channel`` (the memory codec's, or an unpacker), or None (bytes
        as they came)."""
        if channel in s.pack:
            return Unpacker()
        if s.dedup is None or channel != DEDUP_KIND or self.resolver is None:
            return None
        return Decoder(self.resolver(s.dedup))

    def _session_dir(self) -> Path:
        """A fresh directory QEMU may make its sockets in (a name of its own: the session id is not shown)."""
        try:
            self.tunnel_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
            d = self.tunnel_dir / secrets.token_hex(8)
            d.mkdir(mode=0o700)
        except OSError as exc:
            raise EnvironmentProblem(f"cannot make a tunnel directory under {self.tunnel_dir}: {exc} (set "
                                     f"{TUNNEL_DIR_ENV} to a directory this agent may write and QEMU may "
                                     "reach)") from exc
        gid = guestaccess.socket_group()
        if gid is not None:
            os.chown(d, -1, gid)
        os.chmod(d, SESSION_DIR_MODE)
        return d

    def get(self, sid: str, caller: str) -> Session:
        """The live session ``sid`` if ``caller`` opened it: NotFound (unknown, expired), else Forbidden."""
        with self._lock:
            s = self._sessions.get(sid)
            if s is not None and time.monotonic() > s.expires:
                self._purge()
                s = None
        if s is None:
            raise NotFound("no such tunnel session here (unknown, closed or expired): open one with POST /v1/tunnel")
        if s.caller != caller:
            raise Forbidden("this tunnel session was opened with another token: only the token that opened a "
                            "session may use or close it")
        return s

    def close_session(self, sid: str, caller: str | None = None) -> None:
        """End session ``sid`` (``caller``: only if it opened it): its connections are cancelled, its directory
        removed. NotFound for an unknown one."""
        if caller is not None:
            self.get(sid, caller)
        with self._lock:
            s = self._sessions.pop(sid, None)
        if s is None:
            raise NotFound("no such tunnel session here (unknown, closed or expired)")
        self._end(s)

    @contextlib.contextmanager
    def connection(self, s: Session, channel: str) -> Iterator[Target]:
        """One connection of ``channel`` counted while it lasts (at most :data:`CONNECTIONS_PER_CHANNEL`)."""
        if channel not in s.channels:
            raise NotFound(f"tunnel session has no channel {channel[:40]!r}: it has {', '.join(sorted(s.channels))}")
        with self._lock:
            if s.open[channel] >= CONNECTIONS_PER_CHANNEL:
                raise Overloaded(f"tunnel channel {channel} has {CONNECTIONS_PER_CHANNEL} connections open already")
            s.open[channel] += 1
        try:
            yield s.channels[channel]
        finally:
            with self._lock:
                s.open[channel] -= 1

    def live(self, s: Session) -> bool:
        with self._lock:
            return self._sessions.get(s.id) is s

    def close_all(self) -> None:
        with self._lock:
            gone, self._sessions = list(self._sessions.values()), {}
        for s in gone:
            self._end(s)

    def _purge(self) -> None:
        """(Lock held.) Expired sessions with no connection left go, with their directories."""
        now = time.monotonic()
        for sid in [sid for sid, s in self._sessions.items() if now > s.expires and not any(s.open.values())]:
            self._end(self._sessions.pop(sid))

    def _end(self, s: Session) -> None:
        for loop, scope in list(s.stops):
            with contextlib.suppress(RuntimeError):      # (a loop that has stopped: nothing left to end)
                loop.call_soon_threadsafe(scope.cancel)
        if s.directory is not None:
            shutil.rmtree(s.directory, ignore_errors=True)
        for hook in list(self.on_end):                   # (never under the registry's lock: a thread of its own)
            threading.Thread(target=hook, args=(s.id,), name="tunnel-ended", daemon=True).start()


def parse_open(req: Any) -> tuple[list[str], float]:
    """``POST /v1/tunnel``'s body → (kinds, ttl); a path, an unknown kind or a repeated one → InvalidName."""
    usage = (f'give {{"kinds": [KIND, ...], "ttl": SECONDS}} with kinds from {", ".join(KINDS)}: this host '
             "chooses where each goes (a path cannot be given)")
    if not isinstance(req, dict) or set(req) - {"kinds", "ttl", "dedup", "pack"}:
        raise InvalidName(f"malformed tunnel request: {usage}")
    kinds = req.get("kinds")
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) and k in KINDS for k in kinds) \
            or len(set(kinds)) != len(kinds):
        raise InvalidName(f"malformed tunnel request: {usage}")
    return kinds, float(bounds.check(TTL, req.get("ttl", DEFAULT_TTL), "ttl"))


def parse_pack(req: dict[str, Any]) -> list[str]:
    """``POST /v1/tunnel``'s ``pack``: the channels whose source bytes come packed, each one of
    :data:`~capsule.migrate.streampack.PACKABLE` (absent: none)."""
    value = req.get("pack", [])
    if not isinstance(value, list) or not all(isinstance(k, str) and k in PACKABLE for k in value):
        raise InvalidName(f'malformed tunnel request: "pack" lists channels from {", ".join(PACKABLE)}')
    return list(dict.fromkeys(value))


def parse_dedup(req: dict[str, Any]) -> Objects | None:
    """``POST /v1/tunnel``'s ``dedup``: absent or false → None; true → no objects (the hash cache only);
    ``{"objects": [[KIND, ID], ...]}`` → those."""
    value = req.get("dedup", False)
    if value is False or value is None:
        return None
    if value is True:
        return []
    if not isinstance(value, dict) or set(value) - {"objects"}:
        raise InvalidName('malformed tunnel request: "dedup" is true, false or {"objects": [[KIND, ID], ...]}')
    return parse_objects(value.get("objects", []))


async def connect_target(t: Target, wait: float = TARGET_WAIT) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``t``; retried while nothing listens there yet (QEMU has not started listening)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if t.guest:
                sock = await asyncio.to_thread(guestfiles.connect_socket, t.path, "the tunnel's QEMU socket", 5.0)
                sock.setblocking(False)
                return await asyncio.open_unix_connection(sock=sock, limit=CHUNK)
            return await asyncio.open_unix_connection(str(t.path), limit=CHUNK)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if time.monotonic() > deadline:
                raise Unreachable(f"nothing listens on the tunnel's target here after {wait:.0f}s "
                                  f"({type(exc).__name__})") from None
            await asyncio.sleep(0.1)
        except OSError as exc:
            raise Unreachable(f"cannot connect to the tunnel's target here: {exc.strerror or exc}") from None


async def pump(ws: WebSocket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
               decoder: Decoder | Unpacker | None = None, errors: list[str] | None = None) -> None:
    """Bytes both ways between the accepted ``ws`` and the target until both ways ended or either end closed;
    ``decoder``: what the source sends is the memory codec's frames (a stream it refuses is cut: its reason
    goes to ``errors`` and the WebSocket is closed with 1011)."""
    ended = {"in": False, "out": False}
    cut = {"in": False}     # the source went away without ending its stream: a broken link, not an end

    async def inward(scope: anyio.CancelScope) -> None:      # the source's bytes → the target
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                cut["in"] = not ended["in"]
                break
            data = msg.get("bytes")
            if data is None:
                await ws.close(1003, "binary messages only")
                break
            if ended["in"]:
                continue            # (nothing is sent after a half-close: ignored)
            if not data:
                if decoder is not None and await _decoded(decoder.finish) is None:
                    break
                ended["in"] = True
                with contextlib.suppress(OSError):
                    writer.write_eof()
                if ended["out"]:
                    break
                continue
            if decoder is not None:
                data = await _decoded(decoder.decode, data)
                if data is None:
                    break
            writer.write(data)
            await writer.drain()    # back-pressure: the next frame is read once the target took this one
        scope.cancel()

    async def _decoded(step: Callable[..., bytes | None], *args: bytes) -> bytes | None:
        """``step`` of the decoder off the event loop; None (and the stream cut) when it refuses the stream."""
        try:
            out = await asyncio.to_thread(step, *args)
        except Error as exc:
            if errors is not None:
                errors[:] = [*errors[-7:], str(exc)]
            writer.transport.abort()            # QEMU reads a cut stream: its incoming migration fails
            with contextlib.suppress(RuntimeError, OSError):
                await ws.close(1011, str(exc)[:120])
            return None
        return b"" if out is None else out

    async def outward(scope: anyio.CancelScope) -> None:     # the target's bytes → the source
        while data := await reader.read(CHUNK):
            await ws.send_bytes(data)
        await ws.send_bytes(b"")
        ended["out"] = True
        if ended["in"]:
            scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(inward, tg.cancel_scope)
            tg.start_soon(outward, tg.cancel_scope)
    except* (OSError, WebSocketDisconnect, RuntimeError):
        cut["in"] = not ended["in"]     # either end went away (the task group raises them grouped)
    finally:
        if cut["in"]:
            # a cut stream is cut here too, at once: a graceful close would wait for the target to read what is
            # still buffered, and a QEMU that does not read (its post-copy blocked on a page that will not come)
            # would never see its link break, so never pause its post-copy for it to be resumed
            writer.transport.abort()
        else:
            writer.close()
        if ws.application_state == WebSocketState.CONNECTED and ws.client_state == WebSocketState.CONNECTED:
            with anyio.CancelScope(shield=True), contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
                await ws.close(1000)
