"""What the switchover of a live move can send, told to QEMU as the link's own rate (``avail-switchover-bandwidth``).

QEMU switches over when what remains, divided by the bandwidth it measured, fits its downtime limit. It measures
its own writes over the last ~100 ms; those go into the tunnel's entrance, whose buffers (the unix socket, the
codec's batch, a socket's unsent queue) take a burst far faster than the link drains it. On a slow link QEMU
then believes it can send several times more than it can in the pause: B2-live at 8 Mbit/s with a guest dirtying
2 MiB/s was paused 2.5 s against a budget of 1 s.

:class:`SwitchoverRate` measures instead the raw bytes QEMU handed the tunnel per second over the last
:data:`WINDOW` seconds, less the pages the codec sent as references — in steady flow, the link's rate times how
well pages that travel themselves compress: what remains at the switchover is pages just written, which the other
host does not hold — and sets it as QEMU's ``avail-switchover-bandwidth``, which QEMU uses in place of its own
measurement to decide the switchover (QEMU ≥ 8.2). A QEMU that refuses the parameter keeps its own measure.

Given ``wire()`` (the bytes that left for the link), the rate told credits the pages at most :data:`MAX_RATIO`
of compression: the last pages, just written, need not compress as the last seconds' did (B2-live: told 4.7
times the link's rate for the desktop with its office day, paused 10.2 s; 3 times it for the commute case at
384 kbit/s, paused 3.2 s)."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import libvirt
import libvirt_qemu

if TYPE_CHECKING:
    from capsule.migrate.ramdedup import Encoder

log = logging.getLogger(__name__)
WINDOW = 5.0          # seconds of flow the rate is measured over
MIN_SPAN = 2.0        # seconds of samples before a rate is told
CHANGE = 0.1          # a rate is told again only when it moved this much
MAX_RATIO = 2.0       # raw bytes of pages credited per byte on the link, at most


class SwitchoverRate:
    """``raw()``: the bytes QEMU has written into the tunnel so far. Call :meth:`tick` every poll of the job."""

    def __init__(self, dom: libvirt.virDomain, raw: Callable[[], int], clock: Callable[[], float] = time.monotonic,
                 tell: Callable[[int], bool] | None = None, wire: Callable[[], int] | None = None) -> None:
        self.dom = dom
        self.raw = raw
        self.wire = wire
        self.clock = clock
        self.tell = tell or self._qmp
        self.samples: deque[tuple[float, int, int]] = deque()
        self.told: int | None = None
        self.refused = False

    def tick(self) -> int | None:
        """Sample; tell QEMU the rate when there is one and it moved. The rate told (bytes/s), or None."""
        now, raw, wire = self.clock(), self.raw(), self.wire() if self.wire else 0
        self.samples.append((now, raw, wire))
        while self.samples and now - self.samples[0][0] > WINDOW:
            self.samples.popleft()
        t0, r0, w0 = self.samples[0]
        if self.refused or now - t0 < MIN_SPAN or raw <= r0:
            return None
        rate = int((raw - r0) / (now - t0))
        if self.wire is not None:
            rate = max(1, min(rate, int(MAX_RATIO * (wire - w0) / (now - t0))))   # (0 would give QEMU its own)
        if self.told is None or abs(rate - self.told) > CHANGE * self.told:
            if not self.tell(rate):
                self.refused = True
                return None
            self.told = rate
        return self.told

    def _qmp(self, rate: int) -> bool:
        command = {"execute": "migrate-set-parameters", "arguments": {"avail-switchover-bandwidth": rate}}
        try:
            reply = json.loads(libvirt_qemu.qemuMonitorCommand(self.dom, json.dumps(command), 0))
        except (libvirt.libvirtError, ValueError) as exc:
            log.info("QEMU keeps its own switchover bandwidth: %s", exc)
            return False
        if "error" in reply:
            log.info("QEMU keeps its own switchover bandwidth: %s", reply["error"])
            return False
        return True


@dataclass
class Tail:
    """What the switchover of a pre-copy move carried on the migration channel, and how long the tunnel took to
    hand it to the link: from the ram section's END (QEMU's last pass, the guest stopped at the source) to the
    stream's end. The pause also holds what follows it (libvirt's finish calls, the guest started there)."""

    memory_bytes: int = 0          # QEMU's stream from the END to the first device state: the last dirty pages
    device_bytes: int = 0          # QEMU's stream from the first device state to its end
    wire_bytes: int = 0            # the codec's frames from the chunk holding the END on
    seconds: float = 0.0           # from that chunk's arrival to the stream's last bytes handed to the link
    channels: dict[str, int] = field(default_factory=dict)   # bytes each channel carried, both ways, from the stop
                                                               # to the end of libvirt's call (its handover too)

    def as_dict(self) -> dict[str, object]:
        return {"memory_bytes": self.memory_bytes, "device_bytes": self.device_bytes,
                "wire_bytes": self.wire_bytes, "seconds": round(self.seconds, 3), "channels": dict(self.channels)}


class TailWatch:
    """Follows one connection's memory codec (:class:`~capsule.migrate.ramdedup.Encoder`): :meth:`chunk` after
    each chunk it encoded, :meth:`ended` once the stream's last bytes were handed to the link. :attr:`tail` is
    None until a pre-copy switchover was seen (never in post-copy, whose END comes after the guest runs there)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 counters: Callable[[], dict[str, int]] | None = None) -> None:
        self.clock = clock
        self.counters = counters       # the tunnel set's bytes per channel, both ways (taken at the stop)
        self.tail: Tail | None = None
        self._at_stop: dict[str, int] = {}
        self._wire_before = 0          # the codec's frames before the last chunk
        self._wire_start = 0           # ... before the chunk holding the END
        self._at = 0.0

    def chunk(self, encoder: Encoder) -> None:
        if self.tail is None and encoder.parser_counts.end_at is not None:
            self.tail, self._at = Tail(), self.clock()
            self._wire_start = self._wire_before
            self._at_stop = self.counters() if self.counters is not None else {}
        self._wire_before = encoder.stats.wire_bytes

    def ended(self, encoder: Encoder) -> None:
        if self.tail is None:
            return
        counts, stats = encoder.parser_counts, encoder.stats
        end_at = counts.end_at or 0
        device_at = counts.device_at if counts.device_at is not None else stats.stream_bytes
        self.tail.memory_bytes = max(0, device_at - end_at)
        self.tail.device_bytes = max(0, stats.stream_bytes - device_at)
        self.tail.wire_bytes = stats.wire_bytes - self._wire_start
        self.tail.seconds = self.clock() - self._at

    def settle(self) -> None:
        """The channels' bytes since the stop, once libvirt's call has returned (its handover included)."""
        if self.tail is not None and self.counters is not None:
            now = self.counters()
            self.tail.channels = {k: now[k] - self._at_stop.get(k, 0) for k in now}
