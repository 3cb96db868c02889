"""The source side of the byte tunnel a live move uses (the destination side, its routes and its frames, is
:mod:`capsule.exchange.tunnel`).

One call opens a whole tunnel set to a peer and gives what ``virsh migrate --p2p --live`` takes::

    with open_tunnels(peer) as t:                 # POST /v1/tunnel on the peer, then one entrance per kind here
        dom.migrateToURI3(t.libvirt_uri, {"migrate_uri": t.migration_uri, "disks_uri": t.disks_uri, ...})
        t.bytes_sent, t.bytes_received            # what crossed, each way, over every channel
    # closed: the entrances stop listening, their connections end, the session is deleted on the peer

- :func:`~capsule.migrate.tunnelset.open_tunnels` ``(peer, kinds=("libvirt", "qemu-migration", "qemu-disks"), *,
  ttl, local_dir)`` (in :mod:`capsule.migrate.tunnelset`) →
  :class:`Tunnels`: ``.libvirt_uri`` (``qemu+unix:///system?socket=PATH``), ``.migration_uri`` and
  ``.disks_uri`` (``unix:///PATH``; None for a kind not asked for), ``.session``, ``.tunnels`` (kind →
  :class:`Tunnel`), ``.close()``. ``peer``: a :class:`capsule.hosts.Peer` or anything with ``url``, ``token``
  and ``fingerprint`` (the pin, None for http:// or a CA-signed certificate).
- The entrances of ``qemu-migration`` and ``qemu-disks`` are made at the path the destination chose for its
  QEMU's listening socket (libvirt hands both QEMUs the same path); ``local_dir`` puts them there instead (both
  ends on one machine: tests). The ``libvirt`` entrance is in a private directory of its own.
- :class:`Tunnel` is one entrance: a unix socket here (0660, group of the QEMU user where it exists, in a
  directory that user may pass), each accepted connection carried over its own WebSocket
  (``/v1/tunnel/{session}/{channel}``) with the peer's token and pinned certificate, bytes counted each way. It
  runs in a thread with its own asyncio loop (its callers are synchronous). A connection the peer refuses or
  drops is closed here (its local end reads EOF); :attr:`Tunnel.errors` keeps why.

- ``dedup`` (:func:`open_tunnels`): a :class:`Dedup` (the objects whose blocks the peer holds, and their
  :class:`~capsule.migrate.ramdedup.Known` hashes) puts the memory codec on the ``qemu-migration`` channel:
  what QEMU writes there is encoded (:class:`~capsule.migrate.ramdedup.Encoder`, one per connection) if the
  peer answers that it decodes it (``Tunnels.dedup``); a peer that does not (an older release) gets the bytes
  as they came. Held pages go as runs of blocks by place to a peer naming ``memory-runs``, as hashes to one that
  does not. ``Tunnels.memory`` sums the codec's figures. The other direction is never touched.
- ``qemu-disks`` goes packed with zstd (:class:`~capsule.migrate.streampack.Packer`, one per connection) to a
  peer that answers it unpacks it (it names ``tunnel-pack``); ``Tunnels.disks`` sums what was packed.

A peer without the tunnel (an older release) is refused with :class:`~hashcache.errors.ProtocolMismatch` naming
both releases."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from capsule import __version__
from capsule.errors import EnvironmentProblem
from capsule.migrate.memknown import Known
from capsule.migrate.ramdedup import Encoder, Stats
from capsule.migrate.sendqueue import MIN_NOT_SENT, SendQueue, set_bound
from capsule.migrate.streampack import Packer, PackStats
from capsule.migrate.switchover import TailWatch
from capsule.runtime import guestaccess
from hashcache.transport import plain, protocol, tls

KINDS = ("libvirt", "qemu-migration", "qemu-disks")     # what a tunnel session's channels are (never paths)
QEMU_KINDS = ("qemu-migration", "qemu-disks")           # those whose path the destination chooses and names
DEDUP_KIND = "qemu-migration"                           # the channel the memory codec may be applied to
DEDUP_FEATURE = "memory-dedup"                          # an agent that decodes it names this feature
RUNS_FEATURE = "memory-runs"                            # ... and its runs of blocks by place (ramdedup.OP_BLOCKS)
DEFAULT_TTL = 3600.0                                    # seconds a session admits new connections
CHUNK = 1 << 16                                         # bytes of one frame at most (agents take up to 1 MiB)
CONNECT_TIMEOUT = 30.0
CLOSE_TIMEOUT = 10.0
ENTRANCE_MODE = 0o660
ENTRANCE_DIR_MODE = 0o710


class Endpoint(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def token(self) -> str: ...
    @property
    def fingerprint(self) -> str | None: ...


@dataclass
class Counts:
    sent: int = 0            # bytes from here to the peer
    received: int = 0        # bytes from the peer to here
    connections: int = 0     # connections accepted so far
    errors: list[str] = field(default_factory=list)


class Tunnel:
    """One entrance: connections to the unix socket ``path`` here are carried to ``channel`` of ``session`` on
    the agent at ``peer``. A context manager; :meth:`close` stops listening and ends every connection."""

    def __init__(self, peer: Endpoint, session: str, channel: str, path: Path, *,
                 connect_timeout: float = CONNECT_TIMEOUT, known: Known | None = None, runs: bool = False,
                 delta: bool = False, pack: bool = False) -> None:
        plain.check(peer.url)
        self.peer, self.session, self.channel, self.path = peer, session, channel, Path(path)
        self.connect_timeout = connect_timeout
        self.counts = Counts()
        self.known = known                       # not None: each connection's bytes go through an Encoder
        self.runs = runs                         # ... which sends held pages as runs of blocks (the peer decodes them)
        self.delta = delta                       # ... and pages like a held block as deltas (memdelta.py)
        self.pack = pack and known is None      # each connection's bytes go through a Packer (streampack.py)
        self.encoders: list[Encoder] = []
        self.packers: list[Packer] = []
        self.tails: list[TailWatch] = []
        self.counters: Callable[[], dict[str, int]] | None = None   # the set's bytes per channel (TailWatch)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        self._thread = threading.Thread(target=self._run, name=f"tunnel-{channel}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            self._thread.join()
            self._loop.close()
            raise self._failed

    @property
    def bytes_sent(self) -> int:
        return self.counts.sent

    @property
    def bytes_received(self) -> int:
        return self.counts.received

    @property
    def errors(self) -> list[str]:
        return list(self.counts.errors)

    @property
    def memory(self) -> Stats:
        """The memory codec's figures over this entrance's connections (zero without the codec)."""
        total = Stats()
        for e in list(self.encoders):
            total.add(e.stats)
        return total

    @property
    def packed(self) -> PackStats:
        """What this entrance's connections packed (zero when they did not)."""
        total = PackStats()
        for p in list(self.packers):
            total.add(p.stats)
        return total

    def __enter__(self) -> Tunnel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening, end every connection (their local ends read EOF), remove the socket."""
        if self._thread.is_alive() and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(CLOSE_TIMEOUT)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    # -- in the tunnel's thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller waiting in __init__
            self._failed = exc
        finally:
            left = asyncio.all_tasks(self._loop)      # (a closed connection's keepalive, ...)
            for task in left:
                task.cancel()
            with contextlib.suppress(BaseException):
                self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        try:
            server = await asyncio.start_unix_server(self._accepted, path=str(self.path), limit=CHUNK)
        except OSError as exc:
            raise EnvironmentProblem(f"cannot listen on the tunnel's entrance {self.path}: {exc}") from exc
        try:
            gid = guestaccess.socket_group()
            if gid is not None:
                os.chown(self.path, -1, gid)
            os.chmod(self.path, ENTRANCE_MODE)
            self._ready.set()
            await self._stop.wait()
        finally:
            server.close()
            for task in list(self._conns):
                task.cancel()
            if self._conns:
                await asyncio.wait(list(self._conns), timeout=CLOSE_TIMEOUT)
            await server.wait_closed()

    def _url(self) -> str:
        u = urlsplit(self.peer.url)
        return urlunsplit(("wss" if u.scheme == "https" else "ws", u.netloc,
                           f"/v1/tunnel/{self.session}/{self.channel}", "", ""))

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        self.counts.connections += 1
        try:
            ws = await self._open()
            if ws is not None:
                try:
                    await self._pump(ws, reader, writer)
                finally:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(ws.close(), CLOSE_TIMEOUT)
        except asyncio.CancelledError:
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _open(self) -> ClientConnection | None:
        url = self._url()
        try:
            return await connect(url, additional_headers={"Authorization": f"Bearer {self.peer.token}"},
                                 user_agent_header=protocol.user_agent(__version__), max_size=4 * CHUNK,
                                 write_limit=MIN_NOT_SENT,
                                 open_timeout=self.connect_timeout, compression=None,
                                 ssl=tls.client_context(self.peer.fingerprint) if url.startswith("wss://") else None)
        except InvalidStatus as exc:
            body = exc.response.body.decode("utf-8", "replace")[:300] if exc.response.body else ""
            self.counts.errors.append(f"the peer refused the tunnel's connection ({exc.response.status_code}): {body}")
        except (OSError, TimeoutError, WebSocketException) as exc:
            bad = tls.cause(exc)
            self.counts.errors.append(str(tls.explain(self.peer.url, bad)) if bad else
                                      f"the peer does not answer the tunnel ({type(exc).__name__}: {exc})")
        return None

    async def _pump(self, ws: ClientConnection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ended = {"out": False, "in": False}

        encoder: Encoder | Packer | None = None
        tail = TailWatch(counters=self.counters)
        if self.known is not None:
            encoder = Encoder(self.known, runs=self.runs, delta=self.delta)
            self.encoders.append(encoder)
            self.tails.append(tail)
        elif self.pack:
            encoder = Packer()
            self.packers.append(encoder)

        # the bytes this connection may leave unsent, and write at once, follow the link's rate (sendqueue.py):
        # what is queued when QEMU stops the guest must cross the link before the last pages
        sock, queue, sent = ws.transport.get_extra_info("socket"), SendQueue(), 0
        set_bound(sock)

        async def send(data: bytes) -> None:
            nonlocal sent
            step = min(CHUNK, queue.current)
            for at in range(0, len(data), step):    # (never an empty message: that is the half-close)
                await ws.send(data[at:at + step])   # waits while the connection's buffer is full: back-pressure
            self.counts.sent += len(data)
            sent += len(data)
            if (bound := queue.bound(sent)) is not None:
                set_bound(sock, bound)

        async def outward() -> None:            # the local end's bytes → the peer
            while data := await reader.read(CHUNK):
                if encoder is not None:
                    data = await asyncio.to_thread(encoder.encode, data)
                if isinstance(encoder, Encoder):
                    tail.chunk(encoder)
                await send(data)
            if encoder is not None:
                await send(encoder.finish())
            await ws.send(b"")                  # a half-close: no more bytes this way
            if isinstance(encoder, Encoder):
                tail.ended(encoder)
            ended["out"] = True

        async def inward() -> None:             # the peer's bytes → the local end
            async for msg in ws:
                if not isinstance(msg, bytes):
                    raise ConnectionClosed(None, None)
                if not msg:
                    ended["in"] = True
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    if ended["out"]:
                        return
                    continue
                writer.write(msg)
                await writer.drain()
                self.counts.received += len(msg)

        out, into = asyncio.create_task(outward()), asyncio.create_task(inward())
        try:
            done, _ = await asyncio.wait({out, into}, return_when=asyncio.FIRST_COMPLETED)
            if into not in done and out.exception() is None:
                await asyncio.wait({into})      # this way ended: the other goes on until the peer ends it
        finally:
            for t in (out, into):
                t.cancel()
            await asyncio.gather(out, into, return_exceptions=True)
            for t in (out, into):
                exc = None if t.cancelled() else t.exception()
                if isinstance(exc, Exception) and not isinstance(exc, ConnectionClosed | ConnectionError):
                    self.counts.errors.append(f"{type(exc).__name__}: {exc}")
            if ws.close_code == 1011 and ws.close_reason:
                self.counts.errors.append(f"the peer cut the stream: {ws.close_reason}")
