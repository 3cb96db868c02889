"""Slow-loris clients against a receiving agent while a real push runs (for the fault tests and
``bench.faults``).

From another client address than the push's (127.0.0.2: the agent bounds connections per address, and an
attacker is not the pushing host), ``per_kind`` connections of each kind are opened to B's agent (TLS):

- ``handshake``: a TLS ClientHello sent one byte at a time (the handshake never completes);
- ``headers``: TLS done, a request's headers sent one byte at a time;
- ``body``: TLS done, a POST's headers complete (a ``Content-Length`` of 1 MiB) and its body sent one byte
  at a time;
- ``not reading``: TLS done, many requests sent at once and their answers never read.

Meanwhile A pushes ``cap`` to B. The push must complete, and the agent must close every loris connection:
a connection counts as closed once its TCP state leaves ESTABLISHED (the agent's FIN or RST reached it).
Each kind's connections closed and the seconds the last one took go to ``Outcome.detail``."""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
import time

from capsule import transfer
from capsule.store import Store
from capsule.store.objectio import has_object, object_manifest
from hashcache.blocks import BLOCK_SIZE
from testkit.faultkit import Outcome, agent, arrived, sound, top_layer

KINDS = ("handshake", "headers", "body", "not reading")
SOURCE = "127.0.0.2"          # the loris's address, another than the push's
TRICKLE = 0.5                 # s between two bytes
TCP_ESTABLISHED = 1


def _state(sock: socket.socket) -> int:
    """The socket's TCP state (``tcpi_state``)."""
    try:
        return struct.unpack("B", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0]
    except OSError:
        return 0


def _client_hello() -> bytes:
    """The bytes of a TLS ClientHello."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    out = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), out)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


class Loris(threading.Thread):
    """One slow connection of ``kind`` to ``port``; ``closed_after``: seconds until the agent closed it."""

    def __init__(self, kind: str, port: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.kind, self.port, self.stop = kind, port, stop
        self.raw = socket.socket()
        self.raw.bind((SOURCE, 0))
        self.raw.connect(("127.0.0.1", port))
        self.opened = time.monotonic()
        self.closed_after: float | None = None
        self.sock: socket.socket = self.raw
        if kind != "handshake":
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            self.sock = ctx.wrap_socket(self.raw)

    def payload(self) -> bytes:
        if self.kind == "handshake":
            return _client_hello()
        if self.kind == "headers":
            return b"GET /v1/info HTTP/1.1\r\nHost: agent\r\nX-Padding: " + b"a" * 4000 + b"\r\n\r\n"
        return b"a" * (1 << 20)

    def run(self) -> None:
        try:
            if self.kind == "body":
                self.sock.sendall(b"POST /v1/objects/missing HTTP/1.1\r\nHost: agent\r\n"
                                  b"Content-Type: application/json\r\nContent-Length: 1048576\r\n\r\n")
            if self.kind == "not reading":
                self.sock.settimeout(5.0)
                request = b"GET /v1/info HTTP/1.1\r\nHost: agent\r\n\r\n"
                while not self.stop.is_set():
                    self.sock.sendall(request * 256)   # blocks once the agent stops taking them
                return
            for i in range(len(data := self.payload())):
                if self.stop.wait(TRICKLE) or self.closed_after is not None:
                    return
                self.sock.send(data[i:i + 1])
        except (OSError, ValueError):
            return   # the agent closed it (or the send timed out): watched by its TCP state

    def check(self) -> bool:
        """Whether the agent has closed the connection (recorded once)."""
        if self.closed_after is None and _state(self.sock) != TCP_ESTABLISHED:
            self.closed_after = time.monotonic() - self.opened
        return self.closed_after is not None

    def close(self) -> None:
        with_raw = self.sock is not self.raw
        for s in (self.sock, self.raw) if with_raw else (self.raw,):
            with contextlib.suppress(OSError):
                s.close()


def slow_loris(a: Store, b: Store, per_kind: int = 16, wait: float = 240.0) -> Outcome:
    """See the module's docstring. ``wait``: seconds after the push ends for the agent to close them all."""
    lid = top_layer(a)
    raw = object_manifest(a, "layer", lid).nonzero_blocks * BLOCK_SIZE
    out = Outcome("slow-loris during a push")
    ag = agent(b.home)
    stop = threading.Event()
    lorises: list[Loris] = []
    try:
        for kind in KINDS:
            for _ in range(per_kind):
                lorises.append(Loris(kind, ag.port, stop))
                lorises[-1].start()
        out.injected = len(lorises)
        time.sleep(2 * TRICKLE)   # they are all trickling

        def watch() -> None:   # each close is timed when it happens, during the push too
            while not stop.wait(0.1):
                for lo in lorises:
                    lo.check()

        threading.Thread(target=watch, daemon=True).start()
        before = arrived(b, a, lid)
        t0 = time.monotonic()
        report = transfer.push(a, "cap", ag.url, ag.token, fingerprint=ag.fingerprint)
        took = time.monotonic() - t0
        assert report.recorded and has_object(b, "layer", lid) and sound(b) == [], "the push did not complete"
        out.resent = sum(o.fetched_bytes for o in report.objects if o.id == lid)
        out.missing = raw - before
        deadline = time.monotonic() + wait
        while not all([lo.check() for lo in lorises]) and time.monotonic() < deadline and ag.running:
            time.sleep(0.2)
        parts = [f"push {took:.1f} s"]
        for kind in KINDS:
            mine = [lo for lo in lorises if lo.kind == kind]
            closed = [lo.closed_after for lo in mine if lo.closed_after is not None]
            when = f" after {min(closed):.0f}-{max(closed):.0f} s" if closed else f", none within {wait:.0f} s"
            parts.append(f"{kind}: {len(closed)}/{len(mine)} closed{when}")
        out.survived = sum(lo.closed_after is not None for lo in lorises)
        out.detail = "; ".join(parts)
    finally:
        stop.set()
        for lo in lorises:
            lo.close()
        ag.stop()
    return out
