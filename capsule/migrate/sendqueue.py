"""How much a live move's tunnel connection may leave unsent in its socket: about :data:`QUEUE_S` seconds of what
the link carries, between :data:`MIN_NOT_SENT` and :data:`MAX_NOT_SENT` (TCP_NOTSENT_LOWAT).

Whatever waits in a queue when QEMU stops the guest must cross the link before the last pages do, so every queue
between QEMU and the link adds its drain time to the pause. A fixed 128 KiB took 0.13 s to drain at 8 Mbit/s but
2.7 s at 384 kbit/s (B2-live's commute case there: paused 8.3 s against a 1 s budget). :class:`SendQueue` measures
the rate a connection's bytes leave over the last :data:`WINDOW` seconds — while QEMU has more to send, the link's
own rate — and answers a bound worth :data:`QUEUE_S` of it. A small bound costs no throughput: the writer wakes up
for each :data:`MIN_NOT_SENT` bytes the kernel sent, well over a thousand times a second, so a fast link keeps
:data:`MAX_NOT_SENT` and its measured rate can only grow the bound."""

from __future__ import annotations

import contextlib
import socket
import time
from collections import deque
from collections.abc import Callable

QUEUE_S = 0.25               # seconds of the link's rate a connection may leave unsent
MIN_NOT_SENT = 16 * 1024
MAX_NOT_SENT = 128 * 1024    # (without a bound the kernel queued megabytes: 4 s at 8 Mbit/s)
WINDOW = 3.0                 # seconds of sending the rate is measured over
MIN_SPAN = 1.0               # seconds of samples before the bound moves
CHANGE = 0.25                # the bound is set again only when it moved this much


class SendQueue:
    """Call :meth:`bound` with the bytes sent so far; it answers a new bound when one is due, else None."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.current = MAX_NOT_SENT
        self._samples: deque[tuple[float, int]] = deque()

    def bound(self, sent: int) -> int | None:
        now = self.clock()
        self._samples.append((now, sent))
        while now - self._samples[0][0] > WINDOW:
            self._samples.popleft()
        t0, s0 = self._samples[0]
        if now - t0 < MIN_SPAN:
            return None
        want = max(MIN_NOT_SENT, min(MAX_NOT_SENT, int((sent - s0) / (now - t0) * QUEUE_S)))
        if abs(want - self.current) <= CHANGE * self.current:
            return None
        self.current = want
        return want


def set_bound(sock: socket.socket | None, not_sent: int = MAX_NOT_SENT) -> None:
    """At most ``not_sent`` bytes unsent in ``sock``'s kernel queue (TCP_NOTSENT_LOWAT; a socket that is not TCP,
    or a kernel without it, is left as it is)."""
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, not_sent)
