"""libvirt's migration job of a live move, followed until its migrateToURI3 returns (:mod:`capsule.migrate.live`):
its progress for the tracker (rounds, bytes per round, the dirty rate, what remains, the link's bytes), the
switchover rate QEMU is told (:mod:`capsule.migrate.switchover`), a cancel before the point of no return (libvirt's
job aborted), the switchover, and post-copy started when pre-copy stops converging (only when asked for). The
figures it gathers: :class:`LiveFigures`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import libvirt

from capsule.errors import Cancelled
from capsule.migrate.progress import LIVE_PHASES, CancelToken, Tracker
from capsule.migrate.switchover import SwitchoverRate

POLL = 0.5              # seconds between two looks at libvirt's job
STALL_ROUNDS = 1        # pre-copy rounds without what remains shrinking: it does not converge
MIN_ROUNDS_FOR_STALL = 2


@dataclass
class LiveFigures:
    pause_ms: int | None = None          # libvirt's downtime, measured by the other host
    memory_bytes: int = 0                # memory sent by libvirt
    disk_bytes: int = 0                  # the disks' writes since T0, sent by libvirt
    rounds: int = 0                      # pre-copy iterations
    postcopy: bool = False               # post-copy was started
    tunnel_bytes: int = 0                # bytes that crossed the tunnels, both ways (libvirt's streams on the link)
    seconds: float = 0.0                 # libvirt's part (from the prepare to the end)
    memory_refs: int = 0                 # pages sent as references to blocks the other host holds (the codec)
    memory_raw_pages: int = 0            # pages sent themselves, compressed
    memory_wire_bytes: int = 0           # the migration stream's bytes on the link (0: the codec was not used)
    switchover_rate: int | None = None   # bytes/s QEMU was last told it can send in the pause (switchover.py)
    link_breaks: int = 0                 # times the link broke during post-copy and the post-copy was resumed
    switchover: dict[str, Any] | None = None   # what the pre-copy switchover carried (switchover.Tail)
    disks_raw_bytes: int = 0             # the disks' NBD stream from here, as QEMU wrote it
    disks_wire_bytes: int = 0            # ... as it left, packed (streampack.py; the same when not packed)

    def record_tunnels(self, tunnels: Any) -> None:
        """The memory codec's and the disks' packer's figures, from the :class:`~capsule.migrate.tunnelset.Tunnels`
        the move used."""
        m = tunnels.memory
        self.memory_refs, self.memory_raw_pages = m.refs + m.recent, m.raw_pages
        self.memory_wire_bytes = m.wire_bytes
        tail = tunnels.switchover
        self.switchover = tail.as_dict() if tail is not None else None
        disks = tunnels.disks
        self.disks_raw_bytes, self.disks_wire_bytes = disks.raw_bytes, disks.wire_bytes

    def pause_text(self) -> str:
        """How long the guest was paused, as a user reads it: libvirt's downtime, which the other host does not
        report after a post-copy that lost its link and was resumed."""
        if self.pause_ms is not None:
            return f"paused {self.pause_ms} ms"
        if self.link_breaks:
            return "paused for a time libvirt does not report after a resumed post-copy"
        return "paused for a time libvirt did not report"

    def switchover_text(self) -> str:
        """What the switchover sent, as a user reads it ("" when the codec did not see one)."""
        t = self.switchover
        if not t:
            return ""
        text = (f"the switchover sent {t['wire_bytes'] / 1000:.1f} kB for {t['memory_bytes'] / 1000:.1f} kB of the "
                f"last pages and {t['device_bytes'] / 1000:.1f} kB of device state, in {t['seconds']:.2f}s")
        handover = (t.get("channels") or {}).get("libvirt")
        return text + (f"; libvirt's handover {handover / 1000:.1f} kB" if handover is not None else "")

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def watch(dom: libvirt.virDomain, worker: threading.Thread, postcopy: bool, tracker: Tracker,
           cancel: CancelToken, say: Callable[[str], None], errors: list[BaseException],
           link: Callable[[], int], switchover: SwitchoverRate, figures: LiveFigures | None = None) -> LiveFigures:
    """Follow libvirt's job until ``worker`` (its migrateToURI3) ends; ``figures``: those of an earlier attempt,
    continued (a resumed post-copy)."""
    figures = figures or LiveFigures()
    base = tracker.wire_bytes
    best: int | None = None
    stalled = 0
    last_round = -1
    round_start = 0
    aborted = False
    while worker.is_alive():
        worker.join(POLL)
        if not worker.is_alive():
            break
        if cancel.cancelled and not cancel.committed and not aborted:
            say("cancelling: the guest runs on here")
            with contextlib.suppress(libvirt.libvirtError):
                dom.abortJob()
            aborted = True
            continue
        try:
            stats = dom.jobStats(0)
            state, reason = dom.state()
        except libvirt.libvirtError:
            continue
        it = stats.get("memory_iteration")
        processed = int(stats.get("memory_processed", 0))
        if it is not None and it != last_round:
            last_round, round_start = it, processed
            remaining = stats.get("memory_remaining")
            if remaining is not None and it >= MIN_ROUNDS_FOR_STALL:
                if best is None or remaining < best * 0.9:
                    best, stalled = remaining, 0
                else:
                    stalled += 1
        if state == libvirt.VIR_DOMAIN_RUNNING and not figures.postcopy and not aborted:
            figures.switchover_rate = switchover.tick() or figures.switchover_rate
        figures.memory_bytes = max(figures.memory_bytes, processed)
        figures.disk_bytes = max(figures.disk_bytes, int(stats.get("disk_processed", 0)))
        figures.rounds = max(figures.rounds, int(it or 0))
        rate = stats.get("memory_dirty_rate")
        tracker.job(iteration=it, round_bytes=processed - round_start, dirty_rate=None if rate is None else int(rate),
                    remaining=stats.get("memory_remaining"), disk_bytes=figures.disk_bytes,
                    wire=base + link())
        if state == libvirt.VIR_DOMAIN_PAUSED and not figures.postcopy and not aborted and _commit(cancel):
            tracker.no_return()
            tracker.enter("switchover", "the guest pauses here and resumes there")
        if postcopy and not figures.postcopy and not aborted and stalled >= STALL_ROUNDS \
                and state == libvirt.VIR_DOMAIN_RUNNING and _commit(cancel):
            _start_postcopy(dom, tracker, say)
            figures.postcopy = True
    if not aborted and not errors and _commit(cancel):
        tracker.no_return()
        tracker.enter("switchover")
    return figures


def _commit(cancel: CancelToken) -> bool:
    try:
        cancel.commit()
    except Cancelled:
        return False
    return True


def _start_postcopy(dom: libvirt.virDomain, tracker: Tracker, say: Callable[[str], None]) -> None:
    why = ("pre-copy does not converge: post-copy, as asked (if the link breaks now, the guest waits there for it "
           "to return; if it does not, the guest boots here from its disks as they are at the switchover)")
    say(why)
    tracker.replan(LIVE_PHASES)
    tracker.no_return()
    tracker.enter("postcopy", why)
    dom.migrateStartPostCopy(0)


