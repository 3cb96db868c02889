"""HCP, hashed copy (§4.4.3): the wire format and the receiving side.

The protocol has three stateless calls, served by a host agent:

- LOOKUP ``kind/id`` → the object's manifest header (size, parent, record count, digest);
- READ-HASH ``kind/id?start=&count=`` → raw manifest records (40 bytes each: u64 ``index<<1|zero``,
  32-byte hash), zstd-compressed;
- READ ``kind/id`` with a body of block indices → those blocks, concatenated and zstd-compressed.

A receiver rebuilds the manifest from READ-HASH, checks its digest is the
object's name, copies every block its hash cache already has (each verified
by the cache), READs only the rest in batches with many requests in flight,
verifies every block against the manifest, and keeps verified blocks in a
:class:`~hashcache.shadow.Shadow` so a killed transfer resumes where it
stopped. Push reverses the roles of the same pieces: the sender uploads the
manifest and then only the blocks the receiver asks for."""

from __future__ import annotations

import json
import struct
import threading
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import zstandard

from hashcache import native, wirejson
from hashcache.blocks import BLOCK_SIZE, hash_block
from hashcache.bounds import OBJECT_SIZE, blocks_in
from hashcache.errors import HashcacheError, ManifestMismatch
from hashcache.manifest import RECORD_SIZE, Manifest
from hashcache.shadow import Shadow

MAX_BATCH = 1024            # blocks per READ / upload batch
MAX_PART_RECORDS = 8192     # manifest records in one part of a push's manifest upload
DEFAULT_BATCH = 256         # 1 MiB of raw data per request
DEFAULT_LEVEL = 3
LOCAL_BATCH = 4096          # blocks found locally per hash-cache window


class ProtocolError(HashcacheError):
    """A peer sent something malformed."""

    code = "protocol_error"
    exit_code = 13
    http_status = 400


class BlockLookup(Protocol):
    """What a receiver needs from a hash cache: verified data for a hash (or a hash prefix)."""

    def lookup(self, digest: bytes) -> bytes | None: ...

    def lookup_prefix(self, prefix: bytes) -> tuple[bytes, bytes] | None: ...


# -- wire encodings ------------------------------------------------------------

def encode_indices(indices: Sequence[int]) -> bytes:
    """Ascending block indices as LEB128 varints of their deltas (first delta from -1)."""
    out = bytearray()
    prev = -1
    for i in indices:
        d = i - prev - 1
        if d < 0:
            raise ValueError("indices must be strictly ascending")
        while d >= 0x80:
            out.append((d & 0x7F) | 0x80)
            d >>= 7
        out.append(d)
        prev = i
    return bytes(out)


def decode_indices(data: bytes, limit: int, max_count: int = MAX_BATCH) -> list[int]:
    """Inverse of :func:`encode_indices`; refuses more than ``max_count`` indices or any ≥ ``limit``."""
    out: list[int] = []
    prev = -1
    value = shift = 0
    for b in data:
        value |= (b & 0x7F) << shift
        if b & 0x80:
            shift += 7
            if shift > 63:
                raise ProtocolError("block index varint too long")
            continue
        prev = prev + value + 1
        if prev >= limit:
            raise ProtocolError(f"block index {prev} is beyond the object ({limit} blocks)")
        out.append(prev)
        if len(out) > max_count:
            raise ProtocolError(f"more than {max_count} blocks in one request")
        value = shift = 0
    if shift:
        raise ProtocolError("truncated block index list")
    return out


# Reused zstd contexts: making one costs ~15 us, several times compressing a 4 KiB block (a demand-paging
# miss). A small pool rather than thread-locals: nbdkit's Python plugin gives a worker thread a new
# Python thread state per call, so thread-locals would not survive from one READ to the next.
_ZSTD_POOL = 8
_compressors: dict[int, list[zstandard.ZstdCompressor]] = {}
_decompressors: list[zstandard.ZstdDecompressor] = []
_zstd_lock = threading.Lock()


def _compress(raw: bytes, level: int) -> bytes:
    with _zstd_lock:
        free = _compressors.get(level)
        cctx = free.pop() if free else None
    if cctx is None:
        cctx = zstandard.ZstdCompressor(level=level)
    out = cctx.compress(raw)
    with _zstd_lock:
        free = _compressors.setdefault(level, [])
        if len(free) < _ZSTD_POOL:
            free.append(cctx)
    return out


def _decompress(payload: bytes, max_output_size: int) -> bytes:
    with _zstd_lock:
        dctx = _decompressors.pop() if _decompressors else None
    if dctx is None:
        dctx = zstandard.ZstdDecompressor()
    out = dctx.decompress(payload, max_output_size=max_output_size)  # a failure drops the context
    with _zstd_lock:
        if len(_decompressors) < _ZSTD_POOL:
            _decompressors.append(dctx)
    return out


def _refuse_declared(payload: bytes, max_output_size: int, what: str) -> None:
    """Refuse a zstd frame whose header declares more than ``max_output_size`` bytes, from the header alone."""
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError:
        declared = -1  # no readable frame header: decompressing says what is wrong
    if declared > max_output_size:
        raise ProtocolError(f"bad zstd {what}: it declares {declared} bytes, more than the {max_output_size} "
                            "expected")


def decompress_bounded(payload: bytes, max_output_size: int, what: str = "payload", *,
                       dictionary: bytes | None = None) -> bytes:
    """zstd ``payload`` that must decompress to at most ``max_output_size`` bytes (a peer's); anything else
    is a ProtocolError. A frame may declare its content size, and zstandard allocates that much before
    it looks at ``max_output_size``: 14 bytes declaring 2^56 bytes were a MemoryError. Such a frame is
    refused from its header. ``dictionary``: the raw content it was compressed against (:func:`compress_like`)."""
    _refuse_declared(payload, max_output_size, what)
    try:
        if dictionary:
            d = zstandard.ZstdCompressionDict(dictionary, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
            return zstandard.ZstdDecompressor(dict_data=d).decompress(payload, max_output_size=max_output_size)
        return _decompress(payload, max_output_size)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"bad zstd {what}: {exc}") from exc


def compress_like(raw: bytes, dictionary: bytes, level: int = DEFAULT_LEVEL) -> bytes:
    """zstd ``raw`` against ``dictionary`` (raw content the receiver holds too): what it shares costs a few bytes
    a match. :func:`decompress_bounded` with the same ``dictionary`` reverses it."""
    d = zstandard.ZstdCompressionDict(dictionary, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    return zstandard.ZstdCompressor(level=level, dict_data=d).compress(raw)


def pack_blocks(blocks: Iterable[bytes], level: int = DEFAULT_LEVEL, compress: bool = True) -> bytes:
    """Blocks concatenated, as one zstd frame if ``compress`` (by the extension, GIL released: the
    frame ``_reference_pack`` makes with python-zstandard, byte for byte)."""
    raw = b"".join(blocks)
    if not compress:
        return raw
    return native.compress(raw, level)


def _reference_pack(blocks: Iterable[bytes], level: int = DEFAULT_LEVEL, compress: bool = True) -> bytes:
    """Reference (python-zstandard) of :func:`pack_blocks`."""
    raw = b"".join(blocks)
    return _compress(raw, level) if compress else raw


def unpack_blocks(payload: bytes, count: int, compressed: bool = True) -> list[bytes]:
    """Split a READ payload into ``count`` blocks; a payload that does not
    decompress to exactly ``count`` blocks is a protocol error."""
    want = count * BLOCK_SIZE
    if compressed:
        _refuse_declared(payload, want, "payload")  # refused alike by the reference (decompress_bounded)
        try:
            raw = native.decompress(payload, want)
        except native.ZstdError as exc:
            raise ProtocolError(f"bad zstd payload: {exc}") from exc
    else:
        raw = payload
    return _split(raw, count)


def _reference_unpack(payload: bytes, count: int, compressed: bool = True) -> list[bytes]:
    """Reference (python-zstandard) of :func:`unpack_blocks`: the same blocks, the same refusals."""
    want = count * BLOCK_SIZE
    raw = decompress_bounded(payload, want) if compressed else payload
    return _split(raw, count)


def _split(raw: bytes, count: int) -> list[bytes]:
    want = count * BLOCK_SIZE
    if len(raw) != want:
        raise ProtocolError(f"payload holds {len(raw)} bytes, expected {count} blocks")
    mv = memoryview(raw)
    return [bytes(mv[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]) for i in range(count)]


# -- READ over a stream (one WebSocket, many requests) -------------------------------------------
# For demand paging a READ is one small request whose latency the guest waits on; an HTTP request
# costs ~0.5 ms of parsing on each side and ~300 header bytes on the wire, a WebSocket message a few
# bytes and tens of microseconds. Request: u8 kind (0 layer, 1 file), 32-byte object id, u8 zstd
# level (0 = uncompressed), then the indices as in READ. Reply: u8 status (0 ok) + the READ payload,
# or u8 1 + JSON {"detail", "error", "status"} (the HTTP status the same failure would have had).
STREAM_KINDS = ("layer", "file")
_STREAM_HEAD = struct.Struct("<B32sB")
STREAM_OK, STREAM_ERROR = 0, 1


def encode_stream_read(kind: str, oid: str, indices: Sequence[int], level: int) -> bytes:
    """A READ request for the stream (``level`` 0: blocks uncompressed)."""
    return _STREAM_HEAD.pack(STREAM_KINDS.index(kind), bytes.fromhex(oid), level) + encode_indices(indices)


def decode_stream_read(msg: bytes) -> tuple[str, str, int, bytes]:
    """(kind, object id, level, encoded indices) of a stream READ request."""
    if len(msg) < _STREAM_HEAD.size:
        raise ProtocolError(f"stream request of {len(msg)} bytes is shorter than its {_STREAM_HEAD.size}-byte head")
    kind, oid, level = _STREAM_HEAD.unpack_from(msg)
    if kind >= len(STREAM_KINDS):
        raise ProtocolError(f"stream request for unknown object kind {kind}")
    if level > 19:
        raise ProtocolError(f"stream request with zstd level {level} (0..19)")
    return STREAM_KINDS[kind], oid.hex(), level, msg[_STREAM_HEAD.size:]


def encode_stream_error(detail: str, error: str, status: int) -> bytes:
    return bytes([STREAM_ERROR]) + json.dumps({"detail": detail, "error": error, "status": status}).encode()


def decode_stream_reply(msg: bytes) -> tuple[bytes | None, dict[str, Any]]:
    """(payload, {}) for a success, (None, {"detail", "error", "status"}) for a refusal."""
    if not msg:
        raise ProtocolError("empty stream reply")
    if msg[0] == STREAM_OK:
        return msg[1:], {}
    if msg[0] == STREAM_ERROR:
        try:
            err = wirejson.loads(msg[1:])
            if isinstance(err, dict):
                return None, err
        except ValueError:
            pass
    raise ProtocolError(f"malformed stream reply (status byte {msg[0]})")


def manifest_from_parts(header: dict[str, Any], records: bytes, expected_digest: str) -> Manifest:
    """Rebuild a manifest from LOOKUP + READ-HASH and check it names the object."""
    try:
        m = Manifest(kind=header["kind"], algorithm=header["algorithm"], block_size=header["block_size"],
                     size=header["size"], parent=header.get("parent"), record_bytes=records)
    except (KeyError, TypeError) as exc:
        raise ProtocolError(f"malformed LOOKUP reply: {exc}") from exc
    if m.digest != expected_digest:
        raise ManifestMismatch(f"{header.get('kind', 'object')} {expected_digest[:12]}: the manifest the peer sent "
                               f"has digest {m.digest[:12]}", object_name=expected_digest, block=None)
    return m


def header_of(m: Manifest) -> dict[str, Any]:
    return {"kind": m.kind, "algorithm": m.algorithm, "block_size": m.block_size, "size": m.size,
            "parent": m.parent, "count": len(m), "digest": m.digest, "stored_bytes": m.stored_bytes}


PREFIX_SIZE = 8


def compact_records(m: Manifest, start: int, count: int, hash_len: int = PREFIX_SIZE) -> bytes:
    """Manifest records with each hash cut to its first ``hash_len`` bytes (8 + hash_len bytes per
    record). The receiver checks every block against its prefix as it arrives, and the whole object
    against its digest at the end, which authenticates the full hashes it computes itself."""
    raw = m.record_range(start, count)
    if hash_len >= RECORD_SIZE - 8:
        return raw
    step = RECORD_SIZE
    return b"".join(raw[o:o + 8 + hash_len] for o in range(0, len(raw), step))


LIKE_RECORDS = 2 * MAX_PART_RECORDS   # records of a like manifest one part is compressed against, at most
LIKE_SPAN_HEADER = "X-Capsule-Like-Span"   # READ-HASH's answer: FIRST-LAST, the like's records it is against


def like_records(m: Manifest, first: int, last: int, hash_len: int) -> bytes:
    """The records of ``m`` for blocks ``first .. last`` (the first :data:`LIKE_RECORDS`), compacted to
    ``hash_len``: what a manifest part for those blocks is compressed against where the receiver holds ``m``
    (a push's *like*: an older memory image of the same capsule, whose records mostly recur at the same
    places). Both ends make it the same way."""
    start, count = m.records_between(first, last)
    return compact_records(m, start, min(count, LIKE_RECORDS), hash_len)


class Expectation:
    """What a receiver knows of an object before its data arrives: the manifest header (whose
    digest names the object) and per listed block its index, zero flag and hash — or a prefix of
    the hash, when the full hashes are to be computed from the data and checked by the digest."""

    def __init__(self, header: dict[str, Any], digest: str, keys: array[int], hashes: bytes, hash_len: int) -> None:
        self.header = header
        self.digest = digest
        self.keys = keys
        self.hashes = hashes
        self.hash_len = hash_len
        self.block_size = BLOCK_SIZE
        self.size = header["size"]
        self.block_count = -(-self.size // BLOCK_SIZE)

    @classmethod
    def of_manifest(cls, m: Manifest) -> Expectation:
        return cls.from_records(header_of(m), m.record_bytes, m.digest, RECORD_SIZE - 8)

    @classmethod
    def from_records(cls, header: dict[str, Any], data: bytes, digest: str, hash_len: int) -> Expectation:
        """Parse (and validate: this may come from a hostile peer) compact or full records."""
        clean = manifest_header(header)
        size, count = clean["size"], clean["count"]
        if hash_len not in (PREFIX_SIZE, RECORD_SIZE - 8):
            raise ProtocolError(f"unsupported hash length {hash_len}")
        rec = 8 + hash_len
        if len(data) != count * rec:
            raise ProtocolError(f"{len(data)} bytes of records, expected {count} x {rec}")
        nblocks = -(-size // BLOCK_SIZE)
        keys = array("Q")
        hashes = bytearray()
        prev = -1
        for o in range(0, len(data), rec):
            key = int.from_bytes(data[o:o + 8], "little")
            index = key >> 1
            if index <= prev or index >= nblocks:
                raise ProtocolError(f"manifest record for block {index} is out of order or out of range")
            prev = index
            keys.append(key)
            hashes += data[o + 8:o + rec]
        return cls(clean, digest, keys, bytes(hashes), hash_len)

    @classmethod
    def part_of(cls, m: Manifest, start: int, count: int, hash_len: int) -> Expectation:
        """Records ``start .. start+count`` of ``m`` (a part of a manifest sent in pieces)."""
        header = header_of(m)
        n = max(0, min(count, len(m) - start))
        header["count"] = n
        return cls.from_records(header, compact_records(m, start, n, hash_len), m.digest, hash_len)

    @classmethod
    def concat(cls, parts: Sequence[Expectation]) -> Expectation:
        """The parts of one manifest, in order, as one expectation."""
        if not parts:
            raise ProtocolError("no manifest parts")
        first = parts[0]
        keys = array("Q")
        for p in parts:
            if (p.digest, p.hash_len) != (first.digest, first.hash_len) or {
                    k: v for k, v in p.header.items() if k != "count"} != {
                    k: v for k, v in first.header.items() if k != "count"}:
                raise ProtocolError("manifest parts do not belong together")
            if keys and len(p.keys) and p.keys[0] >> 1 <= keys[-1] >> 1:
                raise ProtocolError("manifest parts overlap or are out of order")
            keys.extend(p.keys)
        header = dict(first.header, count=len(keys))
        return cls(header, first.digest, keys, b"".join(p.hashes for p in parts), first.hash_len)

    def __len__(self) -> int:
        return len(self.keys)

    def records(self) -> Iterator[tuple[int, bool, bytes]]:
        n = self.hash_len
        for i, key in enumerate(self.keys):
            yield key >> 1, bool(key & 1), self.hashes[i * n:(i + 1) * n]

    def record(self, index: int) -> tuple[bool, bytes] | None:
        pos = bisect_left(self.keys, index << 1)
        if pos < len(self.keys) and self.keys[pos] >> 1 == index:
            n = self.hash_len
            return bool(self.keys[pos] & 1), self.hashes[pos * n:(pos + 1) * n]
        return None

    def manifest_from(self, block_hash: Callable[[int], bytes]) -> Manifest:
        """The full manifest, with each data block's hash computed by ``block_hash(index)``; raises
        ManifestMismatch unless its digest is the object's name."""
        out = bytearray()
        zero_hash = bytes(RECORD_SIZE - 8)
        for i, key in enumerate(self.keys):
            out += key.to_bytes(8, "little")
            out += zero_hash if key & 1 else block_hash(key >> 1)
            del i
        h = self.header
        try:
            m = Manifest(kind=h["kind"], algorithm=h["algorithm"], block_size=h["block_size"], size=h["size"],
                         parent=h["parent"], record_bytes=bytes(out))
        except HashcacheError as exc:
            raise ManifestMismatch(f"{h['kind']} {self.digest[:12]}: the received data does not form a valid "
                                   f"object ({exc})", object_name=self.digest, block=None) from exc
        if m.digest != self.digest:
            raise ManifestMismatch(f"{h['kind']} {self.digest[:12]}: the received data does not match the object's "
                                   "digest", object_name=self.digest, block=None)
        return m

    def to_bytes(self) -> bytes:
        head = json.dumps(self.header, sort_keys=True).encode()
        n = self.hash_len
        body = b"".join(key.to_bytes(8, "little") + self.hashes[i * n:(i + 1) * n]
                        for i, key in enumerate(self.keys))
        return struct.pack("<II", len(head), n) + head + body

    @classmethod
    def from_bytes(cls, data: bytes, digest: str) -> Expectation:
        if len(data) < 8:
            raise ProtocolError("truncated manifest upload")
        hlen, n = struct.unpack_from("<II", data)
        if hlen > 4096 or len(data) < 8 + hlen:
            raise ProtocolError("bad manifest upload header")
        try:
            header = wirejson.loads(data[8:8 + hlen])
        except ValueError as exc:
            raise ProtocolError(f"bad manifest upload header: {exc}") from exc
        if not isinstance(header, dict):
            raise ProtocolError("bad manifest upload header")
        return cls.from_records(header, data[8 + hlen:], digest, n)


def manifest_header(header: object) -> dict[str, Any]:
    """The manifest header of a LOOKUP reply or a manifest upload (a peer's: checked before any of its
    numbers sizes anything): kind, algorithm, block size, size, parent and record count, the size within
    :data:`~hashcache.bounds.OBJECT_SIZE` and the count at most the object's blocks; else ProtocolError."""
    if not isinstance(header, dict):
        raise ProtocolError("malformed manifest header: expected a JSON object")
    try:
        kind, algorithm, size = header["kind"], header["algorithm"], header["size"]
        block_size, parent, count = header["block_size"], header.get("parent"), header["count"]
    except KeyError as exc:
        raise ProtocolError(f"malformed manifest header: no {exc}") from exc
    if kind not in ("layer", "file") or algorithm != "blake3" or type(block_size) is not int \
            or block_size != BLOCK_SIZE:
        raise ProtocolError(f"unsupported manifest header {header!r:.200}")
    size = OBJECT_SIZE.check_int(size, "manifest size", ProtocolError)
    count = blocks_in(size).check_int(count, f"manifest record count of a {size}-byte {kind}", ProtocolError)
    if parent is not None and (not isinstance(parent, str) or len(parent) != 64):
        raise ProtocolError("bad manifest parent")
    return {"kind": kind, "algorithm": algorithm, "block_size": BLOCK_SIZE, "size": size, "parent": parent,
            "count": count}


def records_chunks(count: int, chunk: int = 65536) -> Iterator[tuple[int, int]]:
    """(start, count) of each READ-HASH request for ``count`` records, one after the other (made as they are
    asked for: ``count`` comes from a peer)."""
    return ((s, min(chunk, count - s)) for s in range(0, count, chunk))


# -- the receiving side ----------------------------------------------------------

@dataclass
class TransferStats:
    """Byte counts of one object's transfer."""

    raw_bytes: int = 0          # non-zero bytes of the object
    resumed_bytes: int = 0      # already in the shadow from an earlier, interrupted run
    cache_bytes: int = 0        # found locally: via the hash cache, or a repeat of a block within the object
    fetched_bytes: int = 0      # raw bytes of blocks that travelled
    wire_bytes: int = 0         # bytes on the wire (bodies + headers, both directions)
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


class Receiver:
    """Receives one object described by ``manifest`` into ``shadow``."""

    def __init__(self, expect: Expectation | Manifest, shadow: Shadow, name: str,
                 cache: BlockLookup | None = None, stats: TransferStats | None = None, dedupe: bool = True) -> None:
        if isinstance(expect, Manifest):
            expect = Expectation.of_manifest(expect)
        if shadow.nblocks < expect.block_count:
            raise ValueError("shadow is smaller than the object")
        self.manifest = expect
        self.shadow = shadow
        self.name = name
        self.cache = cache
        self.stats = stats or TransferStats()
        self._nonzero = [k >> 1 for k in expect.keys if not k & 1]
        self._dedupe = dedupe
        self._by_hash: dict[bytes, list[int]] = {}
        self._indexed = 0  # records of the manifest already in _by_hash
        # a plan's blocks, written but not yet durable nor marked present (until its end: flush)
        self._unsynced: list[int] = []
        self._unsynced_lock = threading.Lock()
        self.stats.raw_bytes = len(self._nonzero) * BLOCK_SIZE

    def update(self, expect: Expectation) -> None:
        """Know more of the object (another part of its manifest arrived)."""
        n = self._indexed
        if self.manifest.keys[:n] != expect.keys[:n] or self.manifest.hashes[:n * expect.hash_len] != expect.hashes[
                :n * expect.hash_len] or self.manifest.hash_len != expect.hash_len:
            self._by_hash, self._indexed = {}, 0  # not an extension of what was known: index it again
        self.manifest = expect
        self._nonzero = [k >> 1 for k in expect.keys if not k & 1]
        self.stats.raw_bytes = len(self._nonzero) * BLOCK_SIZE

    def _duplicates(self) -> dict[bytes, list[int]]:
        """hash → every data block index with that hash (a memory image repeats many pages; a list of
        one is a block without repeats); built as the manifest's parts arrive, each record once."""
        m = self.manifest
        if not self._dedupe or self._indexed == len(m.keys):
            return self._by_hash
        by, keys, hashes, n = self._by_hash, m.keys, m.hashes, m.hash_len
        for pos in range(self._indexed, len(keys)):
            k = keys[pos]
            if not k & 1:
                by.setdefault(hashes[pos * n:(pos + 1) * n], []).append(k >> 1)
        self._indexed = len(keys)
        return by

    def plan(self, on_progress: Callable[[int], None] | None = None) -> list[int]:
        """Blocks still to fetch: not in the shadow (resume), not in the hash
        cache, and one block per distinct hash (repeats are copied locally)."""
        missing = self.shadow.missing(self._nonzero)
        self.stats.resumed_bytes = (len(self._nonzero) - len(missing)) * BLOCK_SIZE
        many = getattr(self.cache, "lookup_prefix_many", None)
        if many is None or self.manifest.hash_len != PREFIX_SIZE:
            return self._reference_plan(missing, on_progress)
        # The hash cache looks a whole window up at once (bucket search, reads and hashes in the
        # compiled extension); same blocks, same order, same counts as _reference_plan.
        still: list[int] = []
        seen: set[bytes] = set()
        record = self.manifest.record
        # a window's blocks are written by a helper thread while the next window is looked up (both in
        # the extension, without the GIL): reads and hashes on the cores, writes beside them
        with ThreadPoolExecutor(1, thread_name_prefix="plan-write") as writer:
            pending: Future[None] | None = None
            for w in range(0, len(missing), LOCAL_BATCH):
                batch = self._plan_window(missing[w:w + LOCAL_BATCH], seen, still, many, record)
                if pending is not None:
                    pending.result()
                pending = writer.submit(self._store, batch, "cache_bytes", on_progress, durable_now=False)
            if pending is not None:
                pending.result()
        self.flush()
        return still

    def _plan_window(self, window: list[int], seen: set[bytes], still: list[int],
                     many: Callable[[list[bytes]], list[tuple[bytes, bytes] | None]],
                     record: Callable[[int], tuple[bool, bytes] | None]) -> list[tuple[int, bytes]]:
        """One window of :meth:`plan`: its blocks found in the hash cache (and their repeats), to store;
        the others appended to ``still``."""
        firsts: list[tuple[int, bytes]] = []
        for index in window:
            rec = record(index)
            assert rec is not None
            h = rec[1]
            if h in seen and self._dedupe:
                continue
            seen.add(h)
            firsts.append((index, h))
        batch: list[tuple[int, bytes]] = []
        for (index, h), hit in zip(firsts, many([h for _i, h in firsts]) if firsts else [], strict=True):
            if hit is None or len(hit[0]) != BLOCK_SIZE or hit[1][:PREFIX_SIZE] != h:
                still.append(index)
                continue
            data = hit[0]
            batch.append((index, data))
            batch.extend((j, data) for j in self._duplicates().get(h, ()) if j != index and not self.shadow.has(j))
        return batch

    def _reference_plan(self, missing: list[int], on_progress: Callable[[int], None] | None) -> list[int]:
        """Reference (one lookup per block) of :meth:`plan`; also the path for caches without batches
        and for full 32-byte hashes."""
        still: list[int] = []
        seen: set[bytes] = set()
        batch: list[tuple[int, bytes]] = []
        for index in missing:
            rec = self.manifest.record(index)
            assert rec is not None
            h = rec[1]
            if h in seen and self._dedupe:
                continue  # a repeat of a block we will fetch: copied when it arrives
            seen.add(h)
            data = self._from_cache(h)
            if data is not None:
                batch.append((index, data))
                batch.extend((j, data) for j in self._duplicates().get(h, ()) if j != index
                             and not self.shadow.has(j))
                if len(batch) >= LOCAL_BATCH:
                    self._store(batch, "cache_bytes", on_progress, durable_now=False)
                    batch = []
            else:
                still.append(index)
        self._store(batch, "cache_bytes", on_progress, durable_now=False)
        self.flush()
        return still

    def _from_cache(self, key: bytes) -> bytes | None:
        if self.cache is None:
            return None
        if len(key) == PREFIX_SIZE:
            # the cache hashed the data it returns; finish() re-checks everything against the digest
            found = self.cache.lookup_prefix(key)
            if found is None or len(found[0]) != BLOCK_SIZE or found[1][:PREFIX_SIZE] != key:
                return None
            return found[0]
        data = self.cache.lookup(key)
        if data is None or len(data) != BLOCK_SIZE or hash_block(data) != key:
            return None
        return data

    def finish(self) -> Manifest:
        """Once complete: the full manifest, its hashes computed from the received blocks (by the
        extension, all cores; reference: ``hash_block(shadow.read(i))`` per block), checked against the
        object's digest (which names it). Raises ManifestMismatch otherwise."""
        if not self.complete():
            raise ProtocolError(f"{self.name}: blocks are still missing")
        flat = self.shadow.hash_blocks(self._nonzero)
        at = {i: flat[k * 32:(k + 1) * 32] for k, i in enumerate(self._nonzero)}
        return self.manifest.manifest_from(at.__getitem__)

    def _store(self, batch: list[tuple[int, bytes]], counter: str,
               on_progress: Callable[[int], None] | None, durable_now: bool = True) -> None:
        """Keep verified blocks: a batch received is written, made durable and marked present before
        this returns (``Shadow.store``: its own fdatasync, whatever other threads do); a plan's window
        (``durable_now`` False) is only written, and the plan makes all it found durable and marks it
        once, at its end (:meth:`flush`)."""
        if not batch:
            return
        if durable_now:
            self.shadow.store(batch)
        else:
            self.shadow.write(batch)
            with self._unsynced_lock:
                self._unsynced.extend(i for i, _d in batch)
        self.stats.add(**{counter: len(batch) * BLOCK_SIZE})
        if on_progress:
            on_progress(len(batch) * BLOCK_SIZE)

    def accept(self, indices: Sequence[int], blocks: Sequence[bytes],
               on_progress: Callable[[int], None] | None = None) -> None:
        """Verify fetched blocks against the manifest and keep them. A wrong
        block raises ManifestMismatch naming the object and the block; blocks
        verified before it are kept (they are correct)."""
        if len(indices) != len(blocks):
            raise ProtocolError(f"{self.name}: asked for {len(indices)} blocks, got {len(blocks)}")
        good: list[tuple[int, bytes]] = []
        try:
            expected: list[bytes] = []
            for index in indices:
                rec = self.manifest.record(index)
                if rec is None or rec[0]:
                    break  # the reference loop below names it, after keeping the blocks before it
                expected.append(rec[1])
            if len(expected) == len(indices) and all(len(b) == BLOCK_SIZE for b in blocks):
                # the extension hashes the batch on every core; the loop below is its reference
                bad = native.verify_blocks(b"".join(blocks), b"".join(expected), self.manifest.hash_len)
                n_ok = len(blocks) if bad < 0 else bad
                good.extend(zip(indices[:n_ok], blocks[:n_ok], strict=True))
                if bad >= 0:
                    raise ManifestMismatch(f"{self.name}: block {indices[bad]} does not match its manifest hash",
                                           object_name=self.name, block=indices[bad])
            else:
                self._reference_verify(indices, blocks, good)
        finally:
            self._keep(good, on_progress)  # blocks verified before a wrong one are kept

    def _keep(self, good: list[tuple[int, bytes]], on_progress: Callable[[int], None] | None) -> None:
        """Store verified fetched blocks, and copies of them where the object repeats them."""
        self._store(good, "fetched_bytes", on_progress)
        dups = self._duplicates()
        copies = [(j, data) for index, data in good
                  for j in dups.get((self.manifest.record(index) or (False, b""))[1], ())
                  if j != index and not self.shadow.has(j)]
        self._store(copies, "cache_bytes", on_progress)

    def _reference_verify(self, indices: Sequence[int], blocks: Sequence[bytes],
                          good: list[tuple[int, bytes]]) -> None:
        """Reference (pure Python) of the batch check in :meth:`accept`; appends verified blocks to ``good``."""
        for index, data in zip(indices, blocks, strict=True):
            rec = self.manifest.record(index)
            if rec is None or rec[0]:
                raise ProtocolError(f"{self.name}: block {index} is not a data block of this object")
            if hash_block(data)[:len(rec[1])] != rec[1]:
                raise ManifestMismatch(f"{self.name}: block {index} does not match its manifest hash",
                                       object_name=self.name, block=index)
            good.append((index, data))

    def flush(self) -> None:
        """Make a plan's blocks written so far durable (one fdatasync), then mark them present."""
        with self._unsynced_lock:
            written, self._unsynced = self._unsynced, []
        if written:
            try:
                self.shadow.sync()
            except BaseException:
                with self._unsynced_lock:
                    self._unsynced[:0] = written
                raise
            self.shadow.mark_present(written)

    def complete(self) -> bool:
        return not self.shadow.missing(self._nonzero)

    def nonzero_indices(self) -> list[int]:
        return list(self._nonzero)


__all__ = [
    "RECORD_SIZE", "STREAM_KINDS", "BlockLookup", "ProtocolError", "Receiver", "TransferStats", "decode_indices",
    "decode_stream_read", "decode_stream_reply", "encode_indices", "encode_stream_error", "encode_stream_read",
    "decompress_bounded", "header_of", "manifest_from_parts", "manifest_header", "pack_blocks", "records_chunks",
    "unpack_blocks",
]
