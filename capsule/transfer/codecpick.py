"""The codec of a transfer's blocks, picked by the link (issue 28): the one whose output keeps the link full
with the fewest bytes.

Each candidate delivers raw bytes at ``min(compress rate, link rate / ratio)``: on a slow link every
candidate waits for the link and the one with the smallest ratio (xz, a high zstd level) delivers the most;
on a fast one the compressor is the limit and zstd -3, or nothing, delivers the most. The link's rate is what
the transfer's own requests measure (:class:`capsule.transfer.pacing.LinkMeter`: bytes per second of the
time requests were in flight); each codec's ratio and speed are running averages over this transfer's
own batches, those it compressed with it and a small sample it compresses now and then only to measure
(``PROBE_BYTES``, every ``PROBE_EVERY`` batches, one candidate at a time). Among candidates within
``NEAR`` of the best delivered rate, the one sending the fewest bytes wins; the codec in use stays
until another delivers ``SWITCH`` more (no flapping between two close ones).

Only codecs the receiver takes are candidates: object streams (zstd from the stream level, xz) where its
``X-Capsule-Streams`` names them, frames (none, zstd -3) everywhere. A given codec (``--zstd-level``,
``--xz``, ``--no-compress``) is not picked but forced."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from capsule.transfer.pacing import LinkMeter
from hashcache import native
from hashcache.blocks import BLOCK_SIZE

FRAME_LEVEL = 3                  # zstd frames, packed by each sending thread
STREAM_LEVELS = (10, 13, 16, 19)  # zstd stream levels tried (from the stream level on)
NEAR = 0.10                      # delivered rates this close to the best count as equal: fewer bytes win
SWITCH = 0.15                    # the codec in use is kept unless another delivers this much more
PROBE_EVERY = 16                 # batches between two probes
PROBE_BLOCKS = 64                # blocks a probe compresses
PROBE_BYTES = PROBE_BLOCKS * BLOCK_SIZE
SMOOTH = 0.3                     # weight of a new measurement in a running average
NO_CPU_LIMIT = 1e12              # bytes/s of sending blocks as they are


@dataclass(frozen=True)
class Codec:
    """How a batch travels: ``none``, ``zstd`` at ``level`` (frames below the stream level, an object
    stream from it) or ``xz`` (an object stream)."""

    name: str
    level: int = 0

    @property
    def label(self) -> str:
        return f"zstd-{self.level}" if self.name == "zstd" else self.name

    def is_stream(self, stream_level: int) -> bool:
        return self.name == "xz" or (self.name == "zstd" and self.level >= stream_level)

    def encode(self, raw: bytes) -> bytes:
        """``raw`` compressed as a fresh stream or frame would carry it (a probe)."""
        if self.name == "xz":
            return native.XzStreamEncoder().segment(raw)
        if self.name == "zstd":
            return native.StreamEncoder(self.level).segment(raw)
        return raw


NONE = Codec("none")
ZSTD3 = Codec("zstd", FRAME_LEVEL)
XZ = Codec("xz")


def candidates(offered: Iterable[str], stream_level: int = STREAM_LEVELS[0], *,
               streams: bool = True) -> list[Codec]:
    """What a receiver naming ``offered`` object-stream codecs takes; ``streams`` False: frames only (a pull
    asks for frames at any level instead)."""
    offered = set(offered)
    out = [NONE, ZSTD3]
    levels = sorted({stream_level, *(lv for lv in STREAM_LEVELS if lv > stream_level)}) if streams else STREAM_LEVELS
    if not streams or offered:     # any codec named: zstd streams (older receivers named no codec but "1")
        out += [Codec("zstd", lv) for lv in levels if FRAME_LEVEL < lv <= 19]
    if streams and "xz" in offered:
        out.append(XZ)
    return out


@dataclass
class _Measure:
    ratio: float | None = None    # wire bytes per raw byte, in use
    probed: float | None = None   # wire bytes per raw byte of a probe's sample
    speed: float | None = None    # raw bytes compressed per second (one thread)
    batch: int = -PROBE_EVERY     # the batch it was last measured at


class CodecPicker:
    """The codec of each object (streams) and each batch (frames) of one transfer; thread-safe.

    ``link`` answers the link's measured rate in bytes/s (None before any answer); ``parallel`` is how many
    frames are packed at once (sending threads, at most the CPUs); ``forced`` is a codec given by the user."""

    def __init__(self, link: Callable[[], float | None], *, parallel: int = 1, forced: Codec | None = None,
                 stream_level: int = STREAM_LEVELS[0], fallback_level: int = FRAME_LEVEL) -> None:
        self.link = link
        self.meter: LinkMeter | None = None
        self.fallback_level = fallback_level
        self.parallel = max(1, min(parallel, os.cpu_count() or 1))
        self.forced = forced
        self.stream_level = stream_level
        self.current: Codec | None = None
        self.link_at_pick: float | None = None
        self._measures: dict[Codec, _Measure] = {}
        # wire bytes in use per wire byte of a probe, of streams (their history) and of frames (batch sizes)
        self._in_use: dict[bool, float] = {}
        self._batches = 0
        self._last_probe = -PROBE_EVERY
        self._lock = threading.Lock()

    # -- measurements ------------------------------------------------------------------------------------

    def record(self, codec: Codec, raw: int, wire: int, seconds: float | None = None, *,
               probe: bool = False) -> None:
        """``raw`` bytes went out as ``wire`` bytes of ``codec`` (``probe``: would have), compressed in
        ``seconds`` (None: not timed here, e.g. the serving side compressed them)."""
        if raw <= 0:
            return
        with self._lock:
            m = self._measures.setdefault(codec, _Measure())
            if probe:
                m.probed = _smooth(m.probed, wire / raw)
            else:
                m.ratio = _smooth(m.ratio, wire / raw)
                if m.probed:
                    kind = codec.is_stream(self.stream_level)
                    self._in_use[kind] = _smooth(self._in_use.get(kind), m.ratio / m.probed)
            if seconds is not None and codec != NONE:
                m.speed = _smooth(m.speed, raw / max(seconds, 1e-6))
            m.batch = self._batches

    def measure(self, codec: Codec, raw: bytes) -> None:
        """Compress ``raw`` with ``codec`` only to measure it (a probe)."""
        t0 = time.perf_counter()
        wire = len(codec.encode(raw))
        self.record(codec, len(raw), wire, time.perf_counter() - t0, probe=True)

    def probe_due(self, allowed: Iterable[Codec]) -> Codec | None:
        """The candidate to measure on the next batch: one never measured first, then the one measured
        longest ago every ``PROBE_EVERY`` batches; counts a batch."""
        if self.forced is not None:
            return None
        with self._lock:
            self._batches += 1
            stale = [c for c in allowed if c != NONE]
            if not stale:
                return None
            oldest = min(stale, key=lambda c: self._measures.get(c, _Measure()).batch)
            m = self._measures.get(oldest)
            if (m is not None and m.probed is not None and m.speed is not None
                    and self._batches - max(m.batch, self._last_probe) < PROBE_EVERY):
                return None
            self._last_probe = self._batches
            return oldest

    def probe(self, allowed: Iterable[Codec], sample: Callable[[], bytes]) -> None:
        """Measure the candidate due (``sample()``: up to ``PROBE_BYTES`` of the batch), if one is. A sample
        is a fresh stream: an object stream's history, which makes its later segments smaller, shows
        only once it is in use."""
        codec = self.probe_due(allowed)
        if codec is not None:
            self.measure(codec, sample()[:PROBE_BYTES])

    def delivered(self, codec: Codec, link: float) -> float | None:
        """Raw bytes per second ``codec`` would deliver over a link of ``link`` bytes/s (None: unmeasured)."""
        m = self._measures.get(codec)
        if codec == NONE:
            return link / self.ratio(codec)
        if m is None or (m.ratio is None and m.probed is None) or m.speed is None:
            return None
        cpu = m.speed * (1 if codec.is_stream(self.stream_level) else self.parallel)
        return min(cpu, link / max(self.ratio(codec), 1e-3))

    def ratio(self, codec: Codec) -> float:
        """Wire bytes per raw byte ``codec`` is expected to send: its probes' ratio as the codecs in use did
        against theirs (so every candidate is judged alike), else its ratio in use (1.0: unmeasured)."""
        m = self._measures.get(codec)
        if m is None:
            return 1.0
        if m.probed is not None:
            return m.probed * self._in_use.get(codec.is_stream(self.stream_level), 1.0)
        return m.ratio if m.ratio is not None else 1.0

    # -- the choice --------------------------------------------------------------------------------------

    def choose(self, allowed: Iterable[Codec]) -> Codec:
        """The codec for what is sent next, among ``allowed`` (what the receiver takes, and what can still
        change: frames only in the middle of an object that started in frames)."""
        allowed = list(allowed)
        if self.forced is not None:   # xz where the receiver takes it, else zstd at the level given (or 3)
            return Codec("zstd", self.fallback_level) if self.forced == XZ and XZ not in allowed else self.forced
        link = self.link()
        with self._lock:
            pick = self._pick(allowed, link)
            self.current = pick
            self.link_at_pick = link
            return pick

    def _pick(self, allowed: list[Codec], link: float | None) -> Codec:
        default = ZSTD3 if ZSTD3 in allowed else allowed[0]
        if link is None:       # nothing measured yet: today's default until the first answers
            return self.current if self.current in allowed else default
        rates = {c: d for c in allowed if (d := self.delivered(c, link)) is not None}
        if not rates:
            return default
        best = max(rates.values())
        near = [c for c, d in rates.items() if d >= (1 - NEAR) * best]
        pick = min(near, key=lambda c: (self.ratio(c), c.level))
        cur = self.current
        if cur is not None and cur in rates and cur != pick and rates[cur] >= rates[pick] / (1 + SWITCH):
            return cur
        return pick


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTH) * old + SMOOTH * new


def forced_codec(codec: str, level: int | None) -> Codec | None:
    """The codec a user gave (``codec`` and ``level`` of :class:`capsule.transfer.terms.Options`;
    None: "auto", the link picks)."""
    if codec == "auto":
        return None
    if codec == "none":
        return NONE
    if codec == "xz":
        return XZ
    return Codec("zstd", level or FRAME_LEVEL)


def for_transfer(codec: str, level: int | None, parallel: int, stream_level: int) -> CodecPicker:
    """The picker of one transfer, with the meter its pacers feed (``picker.meter``)."""
    meter = LinkMeter()
    picker = CodecPicker(meter.rate, parallel=parallel, forced=forced_codec(codec, level), stream_level=stream_level,
                         fallback_level=level or FRAME_LEVEL)
    picker.meter = meter
    return picker


def rate_text(rate: float | None) -> str:
    """A link rate as people say it: ``0.4 Mbit/s``."""
    if rate is None:
        return "not measured"
    mbit = rate * 8 / 1e6
    return f"{mbit:.1f} Mbit/s" if mbit < 100 else f"{mbit:.0f} Mbit/s"
