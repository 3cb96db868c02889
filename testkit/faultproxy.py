"""A TCP proxy that injects link faults in front of an agent, for the fault tests and ``bench.faults``.

It runs an asyncio loop in a thread and forwards every connection to ``target``. On command (or once
``reset_after`` bytes went through in either direction) it can:

- ``reset()``: abort every open connection with a TCP RST (SO_LINGER 0, then close) and answer every new
  one the same way until ``pass_through()``;
- ``half_open()``: keep connections open but forward nothing either way (a peer that stops answering);
- ``pass_through()``: forward again.

``up_rate`` (bytes/s, None: unlimited) paces what goes client→target over all connections together: a slow
link's bottleneck, so that a phase of a transfer lasts long enough to cut the link during it.

``up`` and ``down`` count the bytes forwarded client→target and target→client (TLS records included: the
proxy forwards bytes, it does not terminate TLS; ``url`` is ``https://…`` unless ``tls=False``).

    with FaultProxy("127.0.0.1", agent.port) as proxy:
        proxy.reset_after = 8 << 20
        transfer.push(store, "cap", proxy.url, token, fingerprint=agent.fingerprint)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable

PASS, RESET, HALF_OPEN = "pass", "reset", "half-open"


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a RST rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """A proxy on ``host`` (a free port) to ``target_host:target_port``; see the module's docstring."""

    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1", *, tls: bool = True) -> None:
        self.target = (target_host, target_port)
        self.mode = PASS
        self.up = 0
        self.down = 0
        self.up_new = 0                    # bytes toward the target on connections opened since mark()
        self._generation = 0
        self.resets = 0                    # times the proxy reset its connections
        self.reset_after: int | None = None  # reset once this many bytes went through (up + down)
        self.on_reset: Callable[[], None] | None = None
        self.up_rate: float | None = None  # bytes/s client→target, all connections together
        self._up_free = 0.0                # loop time at which the paced link is free again
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._passing: asyncio.Event | None = None
        ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None

        async def start() -> None:
            self._passing = asyncio.Event()
            self._passing.set()
            self._server = await asyncio.start_server(self._handle, host, 0)
            ready.set()

        self._thread = threading.Thread(target=self._run, args=(start,), daemon=True, name="faultproxy")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        assert self._server is not None
        self.port: int = self._server.sockets[0].getsockname()[1]
        # the bytes pass as they are: a TLS agent behind the proxy is reached with https and its pin
        self.url: str = f"{'https' if tls else 'http'}://{host}:{self.port}"

    def _run(self, start: Callable[[], object]) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(start())  # type: ignore[arg-type]
        self._loop.run_forever()

    # -- commands (from any thread) --------------------------------------------------

    def _call(self, fn: Callable[[], None]) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(10)

    def reset(self) -> None:
        self._call(self._reset)

    def half_open(self) -> None:
        def go() -> None:
            self.mode = HALF_OPEN
            assert self._passing is not None
            self._passing.clear()
        self._call(go)

    def pass_through(self) -> None:
        def go() -> None:
            self.mode = PASS
            assert self._passing is not None
            self._passing.set()
        self._call(go)

    @property
    def total(self) -> int:
        return self.up + self.down

    def close(self) -> None:
        def go() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            self._loop.stop()
        self._loop.call_soon_threadsafe(go)
        self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- in the loop -----------------------------------------------------------------

    def _reset(self) -> None:
        self.mode = RESET
        self.resets += 1
        assert self._passing is not None
        self._passing.set()   # wake the pumps held by a half-open link so they see the reset
        for w in list(self._writers):
            _rst(w)
        self._writers.clear()
        if self.on_reset is not None:
            self.on_reset()

    def mark(self) -> None:
        """Count ``up_new`` from zero, on connections opened from now on: what crossed to a target that was
        listening then (a connection to a killed target's socket writes into a buffer nobody reads)."""
        self._generation += 1
        self.up_new = 0

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        generation = self._generation
        if self.mode == RESET:
            _rst(cw)
            return
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            _rst(cw)
            return
        self._writers.update((cw, uw))
        await asyncio.gather(self._pump(cr, uw, "up", generation), self._pump(ur, cw, "down", generation),
                             return_exceptions=True)
        for w in (cw, uw):
            self._writers.discard(w)
            w.transport.abort()

    async def _pace(self, n: int) -> None:
        assert self.up_rate
        now = self._loop.time()
        start = max(now, self._up_free)
        self._up_free = start + n / self.up_rate
        if self._up_free > now:
            await asyncio.sleep(self._up_free - now)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str,
                    generation: int = 0) -> None:
        assert self._passing is not None
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                while not self._passing.is_set():
                    await self._passing.wait()
                if self.mode == RESET or writer.transport.is_closing():
                    return
                if way == "up" and self.up_rate:
                    await self._pace(len(data))
                writer.write(data)
                await writer.drain()
                setattr(self, way, getattr(self, way) + len(data))
                if way == "up" and generation == self._generation:
                    self.up_new += len(data)
                if self.reset_after is not None and self.total >= self.reset_after:
                    self.reset_after = None
                    self._reset()
                    return
        except (ConnectionError, OSError):
            # a side reset (a killed agent's socket): reset the other side too, as a link would carry it,
            # rather than keep it waiting for an answer that cannot come
            writer.transport.abort()
            return
