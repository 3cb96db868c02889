"""The codec of a transfer's blocks, picked by the link (issue 28): the one that sends them soonest, and
of those that keep the link full, the one sending the fewest bytes.

A candidate ``c`` is expected to take ``max(cpu(c), ratio(c) / link)`` seconds per raw byte, where
``ratio`` is wire bytes per raw byte and ``cpu`` the seconds of compressing (spread over the sending
threads for frames, one thread for a stream) and of decompressing at the receiver, which may share the
cores, times ``CPU_MARGIN`` (the other work of both ends, which a measurement on an idle moment misses).
A stream also waits a round trip per batch, one upload in flight (``STREAM_GAP_S``). The fastest wins; a
candidate within ``NEAR`` of it wins instead only when it sends fewer bytes and its CPU keeps up with the
link (the link, not the CPU, is then the limit). The codec in use stays unless another is ``SWITCH`` faster.

The figures are this transfer's own, as it runs. The link's rate: what its requests measure
(:class:`capsule.transfer.pacing.LinkMeter`: bytes per second of the time requests were in flight). Each
codec's speed: a running average of the time its encode calls took on the batches it sent, else on its
probes — a small sample of a batch compressed now and then only to measure (``PROBE_BYTES``, every
``PROBE_EVERY`` batches, one candidate at a time), decoded again to time the receiver's side. Each codec's
ratio: what it made of a probe's sample against zstd -3 on the same sample (so candidates probed on
different data are judged alike), scaled by what the codecs in use made of whole batches against the
probes of those very batches, for streams and frames apart (a stream's history, a frame smaller or larger
than a sample). A stream's segments after its first are judged against zstd -3 on their whole batch, probed
or not, and its first (no history yet) not at all. Until a stream is in use, its history is judged by
zstd -3 on a sample after the end of the batch sent before it against on the sample alone.

An object stream lasts while its codec stays the pick: the sender asks again at every batch and, when
another is expected ``LEAVE_STREAM`` faster (a stream's history is lost when it ends), waits for the
stream's last segment and goes on in frames or in a new stream (the link changed, or the figures of its
first seconds were wrong). None starts before every candidate that may win is measured and the link has
been measured for a few seconds (a transfer's window opens over its first seconds, so its rate starts
low). Nothing is probed before the link's first answers, and no candidate whose CPU alone takes
``HOPELESS`` times the fastest's expected time, nor a slower one (on a fast link probes of slow codecs
would cost more CPU than the transfer).

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
NEAR = 0.03                      # expected times this close to the fastest: fewer bytes win if the link is full
SWITCH = 0.03                    # the codec in use is kept unless another is expected this much faster
HOPELESS = 4.0                   # CPU alone this many times the fastest's time: neither it nor slower ones probed
LEAVE_STREAM = 0.10              # a stream in use (its history lost when it ends) unless this much faster
CPU_MARGIN = 1.25                # measured CPU seconds count this much more (both ends' other work)
STREAM_GAP_S = 0.03              # a stream's idle link per batch: one upload in flight, a round trip each
PROBE_EVERY = 16                 # batches between two probes
PROBE_BLOCKS = 64                # blocks a probe compresses
PROBE_BYTES = PROBE_BLOCKS * BLOCK_SIZE
MAX_BATCH_BYTES = 256 * BLOCK_SIZE   # a stream's segments: its one upload in flight takes the whole window
SMOOTH = 0.3                     # weight of a new measurement in a running average


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

    def decode(self, payload: bytes, size: int) -> bytes:
        """What :meth:`encode` made of ``size`` raw bytes, decoded as the receiver would (a probe)."""
        if self.name == "xz":
            return native.XzStreamDecoder().segment(payload, size)
        if self.name == "zstd":
            return native.StreamDecoder().segment(payload, size)
        return payload


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
    rel: float | None = None      # wire bytes against zstd -3's on the same probe sample
    ratio: float | None = None    # wire bytes per raw byte of the batches sent with it
    speed: float | None = None    # raw bytes compressed per second (one thread) on the batches sent with it
    probe_speed: float | None = None   # the same on its probes
    decode: float | None = None   # raw bytes decompressed per second (one thread), on its probes
    batch: int = -PROBE_EVERY     # the batch it was last measured at


@dataclass(frozen=True)
class Expected:
    """What a candidate is expected to cost per raw byte: ``seconds`` (the larger of ``cpu`` and ``wire``)
    and ``ratio`` (wire bytes)."""

    cpu: float
    wire: float
    ratio: float

    @property
    def seconds(self) -> float:
        return max(self.cpu, self.wire)

    @property
    def link_full(self) -> bool:
        """Its CPU keeps up with the link: the link, not the CPU, decides when the blocks arrive."""
        return self.cpu <= self.wire


class CodecPicker:
    """The codec of each object (streams) and each batch (frames) of one transfer; thread-safe.

    ``link`` answers the link's measured rate in bytes/s (None before any answer); ``parallel`` is how many
    frames are packed at once (sending threads, at most the CPUs); ``forced`` is a codec given by the user."""

    def __init__(self, link: Callable[[], float | None], *, parallel: int = 1, forced: Codec | None = None,
                 stream_level: int = STREAM_LEVELS[0], fallback_level: int = FRAME_LEVEL) -> None:
        self.link = link
        self.settled: Callable[[], bool] = lambda: True   # the link's rate measured long enough for a stream
        self.meter: LinkMeter | None = None
        self.fallback_level = fallback_level
        self.parallel = max(1, min(parallel, os.cpu_count() or 1))
        self.inflight = max(1, parallel)
        self.forced = forced
        self.stream_level = stream_level
        self.current: Codec | None = None
        self.link_at_pick: float | None = None
        self._measures: dict[Codec, _Measure] = {}
        self._sample_ratio: float | None = None   # zstd -3's wire bytes per raw byte of the probes' samples
        # wire bytes of whole batches per wire byte a probe of the same batch predicts: of streams, of frames
        self._scale: dict[bool, float] = {}
        self._batch_raw: float | None = None      # raw bytes of a batch sent
        self._history: float | None = None        # zstd -3 on a sample after the batch before, against alone
        self._batches = 0
        self._last_probe = -PROBE_EVERY
        self._lock = threading.Lock()

    # -- measurements ------------------------------------------------------------------------------------

    def record(self, codec: Codec, raw: int, wire: int, seconds: float | None = None,
               sample: float | None = None, *, first: bool = False) -> None:
        """A batch of ``raw`` bytes went out as ``wire`` bytes of ``codec``, compressed in ``seconds``
        (None: not timed here, e.g. the serving side compressed them); ``sample``: zstd -3's ratio on a probe
        of this very batch (what :meth:`probe` answered), which tells how whole batches do against samples.

        A stream's ``first`` segment does not judge the stream: it has no history yet, and judged by it a
        stream never shows what its history saves (a push at 1 Mbit/s, whose text went as 0.35 of itself in
        a stream's first segment and 0.06 in the next ones, went back to zstd -3 frames for good after the
        first). Its later segments are judged against their own batch (:meth:`yardstick`)."""
        if raw <= 0:
            return
        with self._lock:
            m = self._measures.setdefault(codec, _Measure())
            m.ratio = _smooth(m.ratio, wire / raw)
            self._batch_raw = _smooth(self._batch_raw, raw)
            m_rel = 1.0 if codec == ZSTD3 else m.rel
            stream = codec.is_stream(self.stream_level)
            if stream and first:
                sample = None
            if sample and m_rel and codec != NONE:
                fresh = _fresh(m_rel, sample, self._sample_ratio)
                self._scale[stream] = _smooth(self._scale.get(stream), (wire / raw) / fresh)
            if seconds is not None and codec != NONE:
                m.speed = _smooth(m.speed, raw / max(seconds, 1e-6))
            m.batch = self._batches

    def record_probe(self, codec: Codec, raw: int, wire: int, reference: int, seconds: float,
                     decode_seconds: float | None = None) -> None:
        """A probe: ``raw`` bytes of a sample made ``wire`` bytes of ``codec`` (``reference``: of zstd -3)
        in ``seconds``, decoded again in ``decode_seconds``."""
        if raw <= 0 or reference <= 0:
            return
        with self._lock:
            m = self._measures.setdefault(codec, _Measure())
            m.rel = _smooth(m.rel, wire / reference)
            self._sample_ratio = _smooth(self._sample_ratio, reference / raw)
            if codec != NONE:
                m.probe_speed = _smooth(m.probe_speed, raw / max(seconds, 1e-6))
            if decode_seconds is not None and codec != NONE:
                m.decode = _smooth(m.decode, raw / max(decode_seconds, 1e-6))
            m.batch = self._batches

    def measure(self, codec: Codec, raw: bytes, before: bytes = b"") -> float:
        """Compress ``raw`` with ``codec`` (and with zstd -3, the yardstick) only to measure it (a probe),
        and decode it again as the receiver would; zstd -3's ratio on ``raw``. ``before``: the end of the
        batch sent before (what a stream would have seen just before ``raw``)."""
        t0 = time.perf_counter()
        wire = codec.encode(raw)
        seconds = time.perf_counter() - t0
        reference = len(wire) if codec == ZSTD3 else len(ZSTD3.encode(raw))
        t1 = time.perf_counter()
        codec.decode(wire, len(raw))
        self.record_probe(codec, len(raw), len(wire), reference, seconds, time.perf_counter() - t1)
        if before and reference > 0:   # a stream's history, which a fresh sample cannot show
            encoder = native.StreamEncoder(FRAME_LEVEL)
            encoder.segment(before)
            after = len(encoder.segment(raw))
            with self._lock:
                self._history = _smooth(self._history, min(1.0, after / reference))
        return reference / max(len(raw), 1)

    @staticmethod
    def yardstick(raw: bytes) -> float:
        """zstd -3's ratio on the whole of ``raw``: what a stream's segment whose batch was not probed is
        judged against (a few milliseconds for a segment of at most ``MAX_BATCH_BYTES``; streams are picked
        where the link, not the CPU, is the limit). Judged against the probes' average, a stream's segment
        of random data after text (what it was probed on) counted twice what was expected, and the stream
        was left for good; judged against its first 256 KiB, so did one whose text gave way to random data
        half-way."""
        return len(ZSTD3.encode(raw)) / max(len(raw), 1)

    def probe_due(self, allowed: Iterable[Codec]) -> Codec | None:
        """The candidate to measure on the next batch: one never probed first, then the one measured
        longest ago every ``PROBE_EVERY`` batches; counts a batch. None before the link's first answers,
        and none that cannot win (:meth:`hopeless`: on a fast link, probing slow codecs costs more CPU than
        the transfer)."""
        if self.forced is not None:
            return None
        link = self.link()
        allowed = list(allowed)
        skip = self.hopeless(allowed, link) if link is not None else set()
        with self._lock:
            self._batches += 1
            if link is None:
                return None
            stale = [c for c in allowed if c != NONE and c not in skip]
            if not stale:
                return None
            oldest = min(stale, key=lambda c: self._measures.get(c, _Measure()).batch)
            m = self._measures.get(oldest)
            if (m is not None and m.rel is not None
                    and self._batches - max(m.batch, self._last_probe) < PROBE_EVERY):
                return None
            self._last_probe = self._batches
            return oldest

    def probe(self, allowed: Iterable[Codec], sample: Callable[[], bytes],
              before: Callable[[], bytes] | None = None) -> float | None:
        """Measure the candidate due (``sample()``: up to ``PROBE_BYTES`` of the batch), if one is. A sample
        is a fresh stream: an object stream's history, which makes its later segments smaller, shows
        only once it is in use (as the scale of streams). Answers zstd -3's ratio on the sample (None: no
        probe), for :meth:`record` of the batch; ``before()``: the end of the batch sent before it."""
        codec = self.probe_due(allowed)
        if codec is None:
            return None
        return self.measure(codec, sample()[:PROBE_BYTES], before()[-PROBE_BYTES:] if before else b"")

    # -- the model ---------------------------------------------------------------------------------------

    def _predicted(self, codec: Codec) -> float | None:
        """Wire bytes per raw byte the probes predict for ``codec`` on a sample (None: not probed)."""
        m = self._measures.get(codec)
        if codec == ZSTD3 and self._sample_ratio is not None:
            return self._sample_ratio
        if m is None or m.rel is None or self._sample_ratio is None:
            return None
        return m.rel * self._sample_ratio

    def ratio(self, codec: Codec) -> float | None:
        """Wire bytes per raw byte ``codec`` is expected to send on whole batches (None: unmeasured)."""
        if codec == NONE:
            return 1.0
        predicted = self._predicted(codec)
        if predicted is not None:
            stream = codec.is_stream(self.stream_level)
            return min(1.0, predicted * self._scale.get(stream, (self._history or 1.0) if stream else 1.0))
        m = self._measures.get(codec)
        return m.ratio if m is not None else None

    def expected(self, codec: Codec, link: float) -> Expected | None:
        """What ``codec`` is expected to cost per raw byte over a link of ``link`` bytes/s (None: unmeasured)."""
        ratio = self.ratio(codec)
        if ratio is None:
            return None
        stream = codec.is_stream(self.stream_level)
        segment = min(self._batch_raw * self.inflight, MAX_BATCH_BYTES) if self._batch_raw else None
        wire = ratio / max(link, 1.0) + (STREAM_GAP_S / segment if stream and segment else 0.0)
        if codec == NONE:
            return Expected(0.0, wire, ratio)
        m = self._measures[codec] if codec in self._measures else _Measure()
        speed = m.speed or m.probe_speed
        if speed is None:
            return None
        cpu = 1 / (speed * (1 if stream else self.parallel)) + (1 / m.decode if m.decode else 0.0)
        return Expected(CPU_MARGIN * cpu, wire, ratio)

    def hopeless(self, allowed: list[Codec], link: float) -> set[Codec]:
        """The candidates that cannot win over a link of ``link`` bytes/s: one measured whose CPU alone
        takes ``HOPELESS`` times the fastest's expected time, and those not measured after it in
        ``allowed`` (cheapest first: zstd levels up, then xz)."""
        costs = {c: e for c in allowed if (e := self.expected(c, link)) is not None}
        if not costs:
            return set()
        best = min(e.seconds for e in costs.values())
        out: set[Codec] = set()
        for c in allowed:
            e = costs.get(c)
            if (e is None and out) or (e is not None and e.cpu > HOPELESS * best):
                out.add(c)
        return out

    # -- the choice --------------------------------------------------------------------------------------

    def choose(self, allowed: Iterable[Codec], keep: Codec | None = None) -> Codec:
        """The codec for what is sent next, among ``allowed`` (what the receiver takes). ``keep``: the codec
        of the object stream in use, kept unless another is expected ``LEAVE_STREAM`` faster."""
        allowed = list(allowed)
        if self.forced is not None:   # xz where the receiver takes it, else zstd at the level given (or 3)
            return Codec("zstd", self.fallback_level) if self.forced == XZ and XZ not in allowed else self.forced
        link = self.link()
        with self._lock:
            pick = self._pick(allowed, link)
            if keep is not None and pick != keep and link is not None:
                now, then = self.expected(keep, link), self.expected(pick, link)
                if now is not None and then is not None and now.seconds <= (1 + LEAVE_STREAM) * then.seconds:
                    pick = keep
            self.current = pick
            self.link_at_pick = link
            return pick

    def _pick(self, allowed: list[Codec], link: float | None) -> Codec:
        default = ZSTD3 if ZSTD3 in allowed else allowed[0]
        if link is None:       # nothing measured yet: today's default until the first answers
            return self.current if self.current in allowed else default
        costs = {c: e for c in allowed if (e := self.expected(c, link)) is not None}
        unmeasured = set(allowed) - set(costs) - self.hopeless(allowed, link)
        if unmeasured or not self.settled():   # no stream on first figures: it lasts a while
            costs = {c: e for c, e in costs.items() if not c.is_stream(self.stream_level)}
        if not costs:
            return default
        fastest = min(costs, key=lambda c: (costs[c].seconds, costs[c].ratio))
        best = costs[fastest].seconds
        fewer = [c for c, e in costs.items() if e.link_full and e.seconds <= (1 + NEAR) * best
                 and e.ratio < costs[fastest].ratio]
        pick = min(fewer, key=lambda c: (costs[c].ratio, c.level)) if fewer else fastest
        cur = self.current
        if (cur is not None and cur in costs and cur != pick
                and costs[cur].seconds <= (1 + SWITCH) * costs[pick].seconds):
            return cur
        return pick


def _fresh(rel: float, sample: float, average: float | None) -> float:
    """What a codec whose probes made ``rel`` of zstd -3's bytes (on samples zstd -3 made ``average`` of
    themselves) is expected to make, as a fresh stream, of a batch zstd -3 makes ``sample`` of: the same
    share of what zstd -3 saves. So data zstd -3 cannot compress stays whole whatever the codec: expected
    as ``rel * sample``, a zstd -19 stream's segment of random data after text (what it was probed on)
    counted 1.5 times what was expected, more than frames send, and the stream was left for good."""
    if average is None or average >= 1.0:
        return rel * sample
    saves = (1.0 - rel * average) / (1.0 - average)
    return min(1.0, max(1.0 - (1.0 - sample) * saves, 1e-3))


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
    picker.settled = meter.settled
    return picker


def rate_text(rate: float | None) -> str:
    """A link rate as people say it: ``0.4 Mbit/s``."""
    if rate is None:
        return "not measured"
    mbit = rate * 8 / 1e6
    return f"{mbit:.1f} Mbit/s" if mbit < 100 else f"{mbit:.0f} Mbit/s"
