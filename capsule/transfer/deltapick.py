"""Whether a push's blocks travel as deltas (``similar.py``), and at which zstd level, picked by the link
like the codec (issue 28): deltas where they send the blocks sooner, measured on this transfer's own data.

Deltas are a candidate of the codec picker's model (``codecpick.py``), one per zstd level of ``LEVELS``.
Per raw byte *tried* (the blocks given to :meth:`capsule.transfer.similar.Similar.split`): ``find`` seconds
of CPU finding the old blocks and encoding (``--patch-from`` at the level, and the zstd -9 yardstick each
delta is judged against; not the reading of both versions' file systems, done once per object), plus
``decode`` seconds rebuilding and verifying them as the receiver does (timed here on a trial's deltas, as
a codec's probes are decoded again); ``share`` of the tried bytes went as deltas, at ``ratio`` wire bytes
per raw byte of those. The blocks of no delta go whole in the codec ``c`` the picker chose. So, per raw
byte tried, over a link of ``link`` bytes/s::

    cpu  = CPU_MARGIN * (find + decode) + (1 - share) * cpu(c)
    wire = (share * ratio + (1 - share) * ratio(c)) / link
    with deltas: max(cpu, wire)        without: max(cpu(c), ratio(c) / link)

Deltas are used where they are expected ``GAIN`` faster; of the levels, the fastest, or one within
``NEAR`` of it that sends fewer bytes and keeps the link full (the codec's rule). zstd -12 against up to
8 MiB of old blocks encodes some 30 MB/s and finds most of what -19 finds, which encodes 2-3 MB/s (three
libraries edited and shifted: 47-70 KB a 4 MB file at -12, 27-29 KB at -19; -9 is as fast as -12 but
misses much on some, 0.94 MB against 47 KB): on a fast link (loopback) whole blocks arrive sooner and
deltas are declined; on a slow one the bytes they save are the time, and on a slower one -19's.

The needed blocks of an object are decided ``SLICE_BLOCKS`` at a time. Until deltas are measured, and
while the link is not (its first answers), a slice is a *trial*: only its first ``TRIAL_BLOCKS`` are tried
(the deltas found are sent, not wasted) and their decoding is timed. Declined deltas are tried again after
``RETRY_SLICES`` slices, twice as long after each decline in a row (the data may change: a layer of
package updates after one of new files). Slices where deltas are used measure them as they go; where
the level used keeps the link full, the first ``TRIAL_BLOCKS`` of a slice measure a smaller level now and
then (every ``RETRY_SLICES`` slices; never again one that cannot win, ``HOPELESS`` as for codecs).

Forced codecs keep what they did before deltas were picked: a stream codec given (``--xz``,
``--zstd-level`` from 10, bytes over speed) sends every block that pays as a delta at zstd -19, any other
codec given none; ``--no-deltas`` none."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from capsule.transfer.codecpick import CPU_MARGIN, HOPELESS, NEAR, Codec, CodecPicker, Expected
from hashcache.delta import DELTA_LEVEL
from hashcache.hcp import MAX_BATCH

TRIAL_BLOCKS = MAX_BATCH // 4     # blocks of a slice tried while deltas are not measured, or declined (1 MiB)
SLICE_BLOCKS = MAX_BATCH          # needed blocks decided at once (4 MiB)
RETRY_SLICES = 8                  # slices after a decline before deltas are tried again (doubling)
GAIN = 0.05                       # deltas used where expected this much faster than whole blocks
LEVELS = (12, DELTA_LEVEL)        # the zstd levels of deltas, the fastest first
OPEN_PRIOR_S = 0.5                # reading both versions' file systems for an object, until measured
OPEN_SHARE = 0.5                  # ... done only where it takes at most this share of the whole blocks' time
SMOOTH = 0.3

# what a slice does: every block tried, only the first TRIAL_BLOCKS (timing their decoding), or none
ALL, TRIAL, NONE = "all", "trial", "none"


@dataclass(frozen=True)
class Plan:
    """What the next slice does: ``mode`` at ``level``; ``probe``: a level to measure on its first
    ``TRIAL_BLOCKS`` instead (None: none)."""

    mode: str
    level: int = LEVELS[0]
    probe: int | None = None


@dataclass
class DeltaCost:
    """What deltas cost per raw byte tried: ``find`` and ``decode`` CPU seconds, the ``share`` of the bytes
    that went as deltas and their ``ratio`` (wire bytes per raw byte of them)."""

    find: float
    decode: float
    share: float
    ratio: float

    def expected(self, whole: Expected, link: float) -> Expected:
        """Per raw byte tried, over ``link`` bytes/s, where the rest goes whole as ``whole`` expects."""
        rest = 1.0 - self.share
        cpu = CPU_MARGIN * (self.find + self.decode) + rest * whole.cpu
        ratio = self.share * self.ratio + rest * whole.ratio
        return Expected(cpu, ratio / max(link, 1.0), ratio)


class DeltaPick:
    """Whether and at which level the next slice of needed blocks is tried as deltas, for one transfer
    (its codec picker's link and codec figures); thread-safe. ``decision`` is the last one taken with
    figures: "used", "declined" or "" (not yet); ``figures`` what it was taken on (seconds per MB with
    and without, the level)."""

    def __init__(self, picker: CodecPicker) -> None:
        self.picker = picker
        self.costs: dict[int, DeltaCost] = {}
        self.decision = ""
        self.figures: dict[str, float] = {}
        self._slices = 0
        self._tried_at: dict[int, int] = {}   # the slice each level was last measured on
        self._wait = RETRY_SLICES
        self.open_cost: float | None = None   # seconds reading an object's two file systems (measured)
        self._lock = threading.Lock()

    @property
    def cost(self) -> DeltaCost | None:
        """The cost of deltas at the fastest level (None: not measured)."""
        return self.costs.get(LEVELS[0])

    def record(self, tried: int, delta_raw: int, wire: int, find_seconds: float,
               decode_seconds: float | None = None, level: int = LEVELS[0]) -> None:
        """``tried`` raw bytes were given to the search at ``level``, ``delta_raw`` of them went as ``wire``
        bytes of deltas; ``find_seconds`` of searching and encoding, ``decode_seconds`` rebuilding (None: not
        timed, the last figure stays)."""
        if tried <= 0:
            return
        with self._lock:
            old = self.costs.get(level)
            find = _smooth(old.find if old else None, find_seconds / tried)
            decode = old.decode if old else 0.0
            if decode_seconds is not None:
                decode = _smooth(old.decode if old else None, decode_seconds / tried)
            share = _smooth(old.share if old else None, delta_raw / tried)
            before = old.ratio if old else None   # nothing went as deltas: their ratio stays
            ratio = _smooth(before, wire / delta_raw) if delta_raw else before if before is not None else 1.0
            self.costs[level] = DeltaCost(find, decode, share, ratio)
            self._tried_at[level] = self._slices

    def expected(self, codec: Codec, link: float, level: int = LEVELS[0]) -> tuple[Expected, Expected] | None:
        """(with deltas at ``level``, without) per raw byte tried, the rest whole in ``codec`` (None:
        unmeasured)."""
        whole = self.picker.expected(codec, link)
        cost = self.costs.get(level)
        if whole is None or cost is None:
            return None
        return cost.expected(whole, link), whole

    def opened(self, seconds: float) -> None:
        """Reading an object's two file systems took ``seconds`` (a fixed cost of its deltas)."""
        with self._lock:
            self.open_cost = _smooth(self.open_cost, seconds)

    def next_slice(self, codec: Codec, remaining: int = 0, opened: bool = True) -> Plan:
        """What the next slice does, its whole blocks going in ``codec`` (the picker's choice for now);
        ``remaining``: the object's raw bytes still to send from it on; ``opened``: whether its file systems
        were read (a trial that must read them first is made only where that costs at most
        ``OPEN_SHARE`` of the time the remaining bytes take whole, and once the link is measured)."""
        link = self.picker.link()
        with self._lock:
            self._slices += 1
            whole = self.picker.expected(codec, link) if link is not None else None
            if not opened:
                if whole is None or link is None:
                    return Plan(NONE)
                fixed = self.open_cost if self.open_cost is not None else OPEN_PRIOR_S
                if fixed > OPEN_SHARE * remaining * whole.seconds:
                    self.figures = {"link": link, "open_s": fixed, "whole_s": remaining * whole.seconds}
                    self.decision = "declined"
                    return Plan(NONE)
            if whole is None or link is None or LEVELS[0] not in self.costs:
                return Plan(TRIAL)   # deltas or the link not measured yet: measure them on a few blocks
            costs = {lv: c.expected(whole, link) for lv, c in self.costs.items()}
            fastest = min(costs, key=lambda lv: (costs[lv].seconds, costs[lv].ratio))
            best = costs[fastest]
            fewer = [lv for lv, e in costs.items() if e.link_full and e.seconds <= (1 + NEAR) * best.seconds
                     and e.ratio < best.ratio]
            level = min(fewer, key=lambda lv: costs[lv].ratio) if fewer else fastest
            pick = costs[level]
            self.figures = {"link": link, "level": level, "with_s_per_mb": pick.seconds * 1e6,
                            "without_s_per_mb": whole.seconds * 1e6, "with_ratio": pick.ratio,
                            "without_ratio": whole.ratio}
            if pick.seconds * (1 + GAIN) < whole.seconds:
                self.decision, self._wait = "used", RETRY_SLICES
                return Plan(ALL, level, self._probe(level, costs))
            self.decision = "declined"
            if self._slices - self._tried_at.get(LEVELS[0], -self._wait) < self._wait:
                return Plan(NONE)
            self._wait *= 2   # tried again now, and if declined again, after twice as long
            return Plan(TRIAL)

    def _probe(self, level: int, costs: dict[int, Expected]) -> int | None:
        """A smaller level than ``level`` to measure now (the one measured longest ago), where ``level``
        keeps the link full (a slower one may then send fewer bytes as soon); None: none due, and none
        whose CPU alone was measured at ``HOPELESS`` times ``level``'s expected time (as codecs)."""
        used = costs[level]
        if not used.link_full:
            return None
        due = [lv for lv in LEVELS[1:] if lv != level
               and self._slices - self._tried_at.get(lv, -RETRY_SLICES) >= RETRY_SLICES
               and not (lv in costs and costs[lv].cpu > HOPELESS * used.seconds)]
        return min(due, key=lambda lv: self._tried_at.get(lv, -RETRY_SLICES)) if due else None


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTH) * old + SMOOTH * new
