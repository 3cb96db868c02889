"""Whether a push's blocks travel as deltas (``similar.py``), picked by the link like the codec (issue 28):
deltas where they send the blocks sooner, measured on this transfer's own data.

Deltas are a candidate of the codec picker's model (``codecpick.py``). Per raw byte *tried* (the blocks
given to :meth:`capsule.transfer.similar.Similar.split`): ``find`` seconds of CPU finding the old blocks
and encoding (``--patch-from``, zstd -19, and the zstd -9 yardstick each delta is judged against), plus
``decode`` seconds rebuilding and verifying them as the receiver does (timed here on a trial's deltas, as
a codec's probes are decoded again); ``share`` of the tried bytes went as deltas, at ``ratio`` wire bytes per
raw byte of those. The blocks of no delta go whole in the codec ``c`` the picker chose. So, per raw byte
tried, over a link of ``link`` bytes/s::

    cpu  = CPU_MARGIN * (find + decode) + (1 - share) * cpu(c)
    wire = (share * ratio + (1 - share) * ratio(c)) / link
    with deltas: max(cpu, wire)        without: max(cpu(c), ratio(c) / link)

Deltas are used where they are expected ``GAIN`` faster. A delta whose old blocks were found costs zstd
-19 against up to 8 MiB, a few MB/s: on a fast link (loopback, a LAN) the whole blocks arrive sooner and
deltas are declined; on a slow one (20 Mbit/s, 384 kbit/s) the bytes they save are the time.

The needed blocks of an object are decided ``SLICE_BLOCKS`` at a time. Until deltas are measured, and
while the link is not (its first answers), a slice is a *trial*: only its first ``TRIAL_BLOCKS`` are tried
(the deltas found are sent, not wasted) and their decoding is timed. Declined deltas are tried again after
``RETRY_SLICES`` slices, twice as long after each decline in a row (the data may change: a layer of
package updates after one of new files). Slices where deltas are used measure them as they go.

Forced codecs keep what they did before deltas were picked: a stream codec given (``--xz``,
``--zstd-level`` from 10, bytes over speed) sends every block that pays as a delta, any other codec given
none; ``--no-deltas`` none."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from capsule.transfer.codecpick import CPU_MARGIN, Codec, CodecPicker, Expected
from hashcache.hcp import MAX_BATCH

TRIAL_BLOCKS = MAX_BATCH // 4     # blocks of a slice tried while deltas are not measured, or declined (1 MiB)
SLICE_BLOCKS = MAX_BATCH          # needed blocks decided at once (4 MiB)
RETRY_SLICES = 8                  # slices after a decline before deltas are tried again (doubling)
GAIN = 0.05                       # deltas used where expected this much faster than whole blocks
SMOOTH = 0.3

# what a slice does: every block tried, only the first TRIAL_BLOCKS (timing their decoding), or none
ALL, TRIAL, NONE = "all", "trial", "none"


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
    """Whether the next slice of needed blocks is tried as deltas, for one transfer (its codec picker's
    link and codec figures); thread-safe. ``decision`` is the last one taken with figures: "used",
    "declined" or "" (not yet); ``figures`` what it was taken on (seconds per MB with and without)."""

    def __init__(self, picker: CodecPicker) -> None:
        self.picker = picker
        self.cost: DeltaCost | None = None
        self.decision = ""
        self.figures: dict[str, float] = {}
        self._slices = 0
        self._tried_at: int | None = None   # the slice deltas were last measured on
        self._wait = RETRY_SLICES
        self._lock = threading.Lock()

    def record(self, tried: int, delta_raw: int, wire: int, find_seconds: float,
               decode_seconds: float | None = None) -> None:
        """``tried`` raw bytes were given to the search, ``delta_raw`` of them went as ``wire`` bytes of
        deltas; ``find_seconds`` of searching and encoding, ``decode_seconds`` rebuilding (None: not timed,
        the last figure stays)."""
        if tried <= 0:
            return
        with self._lock:
            old = self.cost
            find = _smooth(old and old.find, find_seconds / tried)
            decode = old.decode if old else 0.0
            if decode_seconds is not None:
                decode = _smooth(old and old.decode, decode_seconds / tried)
            share = _smooth(old and old.share, delta_raw / tried)
            ratio = _smooth(old and old.ratio, wire / delta_raw) if delta_raw else (old.ratio if old else 1.0)
            self.cost = DeltaCost(find, decode, share, ratio)
            self._tried_at = self._slices

    def expected(self, codec: Codec, link: float) -> tuple[Expected, Expected] | None:
        """(with deltas, without) per raw byte tried, the rest whole in ``codec`` (None: unmeasured)."""
        whole = self.picker.expected(codec, link)
        if whole is None or self.cost is None:
            return None
        return self.cost.expected(whole, link), whole

    def next_slice(self, codec: Codec) -> str:
        """What the next slice does (:data:`ALL`, :data:`TRIAL`, :data:`NONE`), its whole blocks going in
        ``codec`` (the picker's choice for now)."""
        link = self.picker.link()
        with self._lock:
            self._slices += 1
            figures = self.expected(codec, link) if link is not None else None
            if figures is None:   # deltas or the link not measured yet: measure them on a few blocks
                return TRIAL
            with_, without = figures
            self.figures = {"link": link, "with_s_per_mb": with_.seconds * 1e6,
                            "without_s_per_mb": without.seconds * 1e6, "with_ratio": with_.ratio,
                            "without_ratio": without.ratio}
            if with_.seconds * (1 + GAIN) < without.seconds:
                self.decision, self._wait = "used", RETRY_SLICES
                return ALL
            self.decision = "declined"
            if self._tried_at is not None and self._slices - self._tried_at < self._wait:
                return NONE
            self._wait *= 2   # tried again now, and if declined again, after twice as long
            return TRIAL


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTH) * old + SMOOTH * new
