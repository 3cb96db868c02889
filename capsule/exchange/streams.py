"""Block uploads as one zstd stream per object (the receiving side's state).

A sender whose receiver offers it (``STREAMS_HEADER`` on ``begin``'s answer) compresses the batches of
one object as flushed segments of one zstd stream: a later batch matches what earlier ones carried, so
an object's blocks compress as well as one stream of them at any batch size (a new ruby package layer
at zstd -19: 10.2 MB against 12.5 MB in frames of 256 blocks and 14.5 MB in the 16-block batches of a
slow link). Each upload names the stream (an id the sender picks), its place in it (``seq`` from 0) and
its codec: ``zstd`` (at the sender's level) or ``xz`` (LZMA2 at xz's default preset, an 8 MiB
dictionary: 5-9 % fewer bytes than a zstd -19 stream on new Debian packages, about as slow to
compress). The receiver names the codecs it takes in ``STREAMS_HEADER``.

Here: one decoder per object, taking segments strictly in order. A segment already taken is answered
again as taken (a retried upload); one whose predecessors this receiver does not have (it restarted, or
dropped the stream after a bad segment) raises :class:`ObjectStreamLost`, and the sender starts a new
stream after planning again (the blocks already kept stay kept). Ordering uploads that arrive early is
the caller's (the agent waits for their turn without holding a thread: ``capsule/agent/turns.py``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from capsule.errors import Conflict
from hashcache import native
from hashcache.blocks import BLOCK_SIZE
from hashcache.hcp import ProtocolError

STREAMS_HEADER = "X-Capsule-Streams"   # on begin's answer: the codecs of the object streams taken here
# a codec's decoder: segment(payload, size) -> exactly size bytes, or its error (a ValueError)
DECODERS: dict[str, Callable[[], native.StreamDecoder | native.XzStreamDecoder]] = {
    "zstd": native.StreamDecoder, "xz": native.XzStreamDecoder}
CODECS = ",".join(DECODERS)

MAX_STREAMS = 16                       # decoders kept (an 8 MiB window or dictionary each at most)
MAX_STREAM_ID = 64


def offered_codecs(header: str | None) -> set[str]:
    """The codecs a receiver's ``STREAMS_HEADER`` names (none when absent)."""
    return {c.strip() for c in (header or "").split(",") if c.strip()}


class ObjectStreamLost(Conflict):
    """The receiver does not have the stream this segment continues; start a new one."""

    code = "stream_lost"


@dataclass
class _Stream:
    sid: str
    codec: str
    decoder: native.StreamDecoder | native.XzStreamDecoder
    taken: int = 0                    # segments decoded and kept
    lock: threading.Lock = field(default_factory=threading.Lock)


class Streams:
    """The open object streams of one receiving store, by (kind, object id); thread-safe."""

    def __init__(self, limit: int = MAX_STREAMS) -> None:
        self._limit = limit
        self._streams: OrderedDict[tuple[str, str], _Stream] = OrderedDict()
        self._lock = threading.Lock()

    def position(self, key: tuple[str, str], sid: str) -> int | None:
        """Segments taken so far of stream ``sid`` of ``key`` (None: not open here)."""
        with self._lock:
            st = self._streams.get(key)
            return st.taken if st is not None and st.sid == sid else None

    def take(self, key: tuple[str, str], sid: str, seq: int, count: int, payload: bytes,
             keep: Callable[[list[bytes]], None], codec: str = "zstd") -> bool:
        """Decode segment ``seq`` (``count`` blocks) of a ``codec`` stream and hand its blocks to ``keep``;
        False if it was taken before. Any failure (a bad segment, blocks ``keep`` refuses) drops the stream."""
        if not sid or len(sid) > MAX_STREAM_ID or not sid.isalnum() or seq < 0:
            raise ProtocolError(f"bad object stream {sid[:MAX_STREAM_ID]!r} segment {seq}")
        if codec not in DECODERS:
            raise ProtocolError(f"object stream {sid}: unknown codec {codec[:16]!r} (this receiver takes {CODECS})")
        with self._lock:
            st = self._streams.get(key)
            if st is None or st.sid != sid:
                if seq != 0:
                    raise ObjectStreamLost(f"{key[0]} {key[1][:12]}: object stream {sid} is not open here "
                                          f"(segment {seq}); start a new one")
                st = self._streams[key] = _Stream(sid, codec, DECODERS[codec]())
                while len(self._streams) > self._limit:
                    self._streams.popitem(last=False)
            self._streams.move_to_end(key)
        with st.lock:
            if codec != st.codec:
                self.drop(key)
                raise ProtocolError(f"{key[0]} {key[1][:12]}: segment {seq} of {st.codec} object stream {sid} "
                                    f"says it is {codec}")
            if seq < st.taken:
                return False
            if seq > st.taken:
                raise ObjectStreamLost(f"{key[0]} {key[1][:12]}: segment {seq} of object stream {sid} came "
                                      f"before segment {st.taken}")
            try:
                raw = st.decoder.segment(payload, count * BLOCK_SIZE)
                keep([raw[k * BLOCK_SIZE:(k + 1) * BLOCK_SIZE] for k in range(count)])
            except (native.ZstdError, native.XzError) as exc:
                self.drop(key)
                raise ProtocolError(f"{key[0]} {key[1][:12]}: segment {seq} of object stream {sid}: {exc}") from exc
            except BaseException:
                self.drop(key)
                raise
            st.taken += 1
            return True

    def drop(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._streams.pop(key, None)
