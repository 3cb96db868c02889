"""Pacing a transfer's block requests to the link: at most a few seconds' worth of bytes in flight.

A push's block upload is answered only once the receiver has the whole body, while the sender's socket
buffers (and anything buffering on the path) take the body at once. With a fixed number of large uploads
in flight on a slow link (8 × 1 MiB at 384 kbit/s is three minutes of data), every answer comes after the
client's read timeout, the uploads are sent again and the link carries the same blocks several times.
A pull's READ answers queue the same way in the other direction: the agent hands each answer to its
socket at once, and answers that stay queued on the link for minutes were cut off by the agent's side
(over TLS at 384 kbit/s, 8 × 1 MiB answers in flight: a 12 MiB pull failed after 817 s with 40 MB on the
link; paced, it took 278 s and 13.9 MB). Pulls are paced by the same window.
So the window (bytes in flight) follows the rate the receiver has been acknowledging, like TCP's window
follows its ACKs: ``TARGET_S`` seconds of it, never less than one small batch, and batches shrink to fit
it across the in-flight slots. On a LAN the window opens after the first answers and the fixed limits
(batch size, in-flight requests) are what bound it.

A :class:`LinkMeter` shared by a transfer's pacers measures the link itself for the codec choice
(``codecpick.py``): wire bytes acknowledged per second of the time at least one request was in flight, over
the last ``LINK_SPAN_S`` of it. Time the sender spent compressing with nothing on the wire does not count,
so a slow codec on a fast link is not taken for a slow link."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from hashcache.blocks import BLOCK_SIZE

TARGET_S = 4.0          # seconds of acknowledged rate allowed in flight
MIN_WINDOW = 256 << 10  # bytes in flight before any answer came back
MIN_BATCH = 16          # blocks: below this the per-request overhead starts to count
RATE_SPAN_S = 20.0      # the rate is measured over the answers of this many last seconds
LINK_SPAN_S = 3.0       # the link's rate: over this many last seconds with requests in flight,
LINK_AGE_S = 10.0       # and none answered longer ago than this (a link that changed shows soon)


class LinkMeter:
    """The link's rate over a transfer's requests (all its objects): bytes per busy second; thread-safe."""

    def __init__(self, span_s: float = LINK_SPAN_S) -> None:
        self.span_s = span_s
        self._lock = threading.Lock()
        self._active = 0
        self._busy = 0.0                  # busy seconds before the current busy stretch
        self._since = 0.0                 # when the current busy stretch began
        self._bytes = 0
        # (busy seconds, bytes, when) at each answer
        self._marks: deque[tuple[float, int, float]] = deque([(0.0, 0, time.monotonic())])

    def _busy_now(self, now: float) -> float:
        return self._busy + (now - self._since if self._active else 0.0)

    def started(self) -> None:
        """A request went on the wire."""
        with self._lock:
            if not self._active:
                self._since = time.monotonic()
            self._active += 1

    def ended(self, wire_bytes: int | None) -> None:
        """A request ended: answered (its wire bytes count) or failed (None)."""
        with self._lock:
            now = time.monotonic()
            busy = self._busy_now(now)
            self._active -= 1
            if not self._active:
                self._busy = busy
            if wire_bytes:
                self._bytes += wire_bytes
                self._marks.append((busy, self._bytes, now))
                while len(self._marks) > 2 and (busy - self._marks[1][0] >= self.span_s
                                                or now - self._marks[1][2] > LINK_AGE_S):
                    self._marks.popleft()

    def settled(self) -> bool:
        """Requests have been in flight for ``span_s`` seconds: a transfer's window opens over its first
        seconds, and the rate measured before says more about the window than about the link."""
        with self._lock:
            return self._busy_now(time.monotonic()) >= self.span_s

    def rate(self) -> float | None:
        """Bytes per busy second over the last ``span_s`` busy seconds (None before any answer)."""
        with self._lock:
            if len(self._marks) < 2:
                return None
            (b0, n0, _t0), (b1, n1, _t1) = self._marks[0], self._marks[-1]
            return (n1 - n0) / max(b1 - b0, 1e-4)


class Pacer:
    """The window and batch size of one push or pull; thread-safe (the pipeline's threads share it)."""

    def __init__(self, max_batch: int, inflight: int, timeout: float | None = None,
                 meter: LinkMeter | None = None) -> None:
        self.meter = meter or LinkMeter()
        self.max_batch = max(1, max_batch)
        self.inflight = max(1, inflight)
        # with a short client timeout the window must drain well within it
        self.target_s = min(TARGET_S, timeout / 4) if timeout else TARGET_S
        self._lock = threading.Condition()
        self._in_flight = 0
        self._acked: deque[tuple[float, int]] = deque()   # (when, wire bytes) of each answered upload
        self._t0: float | None = None                         # when the first upload was let through
        self._wire_per_block = float(BLOCK_SIZE)

    def rate(self) -> float | None:
        """Bytes per second acknowledged over the last ``RATE_SPAN_S`` (None before the first answer)."""
        with self._lock:
            return self._rate_locked()

    def _rate_locked(self) -> float | None:
        if not self._acked or self._t0 is None:
            return None
        now = time.monotonic()
        start = max(self._t0, now - RATE_SPAN_S)
        return sum(n for t, n in self._acked if t >= start) / max(now - start, 1e-3)

    def window(self) -> int:
        with self._lock:
            return self._window_locked()

    def _window_locked(self) -> int:
        rate = self._rate_locked()
        return MIN_WINDOW if rate is None else max(MIN_WINDOW, int(rate * self.target_s))

    def batch_size(self) -> int:
        """Blocks in the next batch: the window shared by the in-flight slots, within the batch limits."""
        with self._lock:
            fit = self._window_locked() / self.inflight / self._wire_per_block
        return max(MIN_BATCH, min(self.max_batch, int(fit)))

    def batches(self, indices: list[int]) -> Iterator[list[int]]:
        """``indices`` cut into batches, each sized when it is taken (so later ones follow the rate)."""
        i = 0
        while i < len(indices):
            n = self.batch_size()
            yield indices[i:i + n]
            i += n

    @contextmanager
    def flight(self, blocks: int) -> Iterator[list[int]]:
        """Wait for room in the window for ``blocks`` blocks, then send; append the request's wire bytes
        to the yielded list once sent (they count as acknowledged when the block exits without error)."""
        est = int(blocks * self._wire_per_block)
        with self._lock:
            while self._in_flight and self._in_flight + est > self._window_locked():
                self._lock.wait(1.0)
            self._in_flight += est
            if self._t0 is None:
                self._t0 = time.monotonic()
        sent: list[int] = []
        ok = False
        self.meter.started()
        try:
            yield sent
            ok = True
        finally:
            self.meter.ended(sent[0] if ok and sent else None)
            with self._lock:
                self._in_flight -= est
                if ok and sent:
                    now = time.monotonic()
                    self._acked.append((now, sent[0]))
                    while now - self._acked[0][0] > RATE_SPAN_S:
                        self._acked.popleft()
                    self._wire_per_block = 0.8 * self._wire_per_block + 0.2 * sent[0] / max(1, blocks)
                self._lock.notify_all()
