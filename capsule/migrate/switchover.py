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

import libvirt
import libvirt_qemu

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
