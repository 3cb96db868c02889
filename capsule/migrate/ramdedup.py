"""The memory codec of a live move's ``qemu-migration`` channel: RAM pages the destination already holds travel as
references, the rest compressed; the destination rebuilds QEMU's stream byte for byte.

- :class:`Encoder` (source): QEMU's stream in (:mod:`ramstream` finds its pages), frames out. A page whose BLAKE3
  is :class:`Known` (in the manifests of objects both hosts hold) goes as a reference (its 32-byte hash); a page
  equal to one of the last :data:`WINDOW` pages of this connection goes as that page's number; every other byte
  (raw runs, other pages) is zstd-compressed as one stream over the connection, flushed at the end of each call
  (a call never holds bytes back: QEMU's stream has requests and answers, and must not stall in the codec), so a
  batch matches what earlier batches sent.
- :class:`Decoder` (destination): frames in, QEMU's stream out. A reference is resolved through ``resolve``
  (:class:`StoreResolver`: this host's hash cache, then the blocks of the objects named) and its BLAKE3 checked
  before a byte goes on; a reference it cannot resolve, a page whose hash differs, or malformed framing raise
  :class:`~capsule.errors.IntegrityError` naming what is wrong: QEMU's incoming migration then fails, and the
  guest, still in pre-copy, runs on at the source.

Framing (big-endian): a batch per frame::

    u8 'B', be32 ops_len, be32 payload_len, be32 out_len, ops[ops_len], payload[payload_len]
    payload: the next part of the connection's one zstd stream (flushed to a block boundary): the raw runs and
             literal pages, in order, out_len bytes once decompressed
    ops: 0x01 be32 n   n bytes of the payload (not a page)       0x02   a page: 4096 bytes of the payload
         0x03 hash32   a page by reference                       0x04 be32 seq   the page numbered seq
         0x05 be16 object, be32 block, be32 n, be64 head   a run: n pages, blocks block.. of the object numbered
                       so in the move's objects, each checked at the destination against its manifest there;
                       from the second on, each after its page header, head + (i - 1) * 4096 (the next page in
                       the same RAM block). 19 bytes for what takes 0x01 and 0x03 46 bytes a page.
         0x06 be16 object, be32 block, be16 n, delta[n]   a page as zstd against that block (``memdelta``),
                       the block checked against its manifest first and the page against the delta's checksum

A peer that names the feature ``memory-runs`` decodes 0x05; the encoder sends held pages so (``runs``) to such a
peer, as 0x03 to one that does not. One that names ``memory-delta`` decodes 0x06 (``delta``: pages similar to a
block of :attr:`Known.similar`). A commute's memory image is mapped-ram: a page at the same guest address as
yesterday is the same block of yesterday's image, so runs are long (the tiny guest's commute at 384 kbit/s sent
29,604 held pages as 0x01 and 0x03, about 1.3 MB of its 5.84 MB).

Every page (literal or referenced) is numbered in order from 0; both ends keep the last :data:`WINDOW` of them.
Bounds the decoder holds a peer to: ops ≤ :data:`MAX_OPS` bytes, out_len ≤ :data:`MAX_PAYLOAD`, a batch's
output ≤ :data:`MAX_OUT`; its memory is the window (32 MiB) plus one batch."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import zstandard

from capsule.errors import IntegrityError
from capsule.migrate.memdelta import undelta
from capsule.migrate.memknown import Known
from capsule.migrate.ramstream import F_CONTINUE, F_PAGE, FLAGS_MASK, PAGE, PAGE_SIZE, Counts, RamStream
from capsule.migrate.streampack import PartReader, packed_bound
from hashcache.blocks import HASH_SIZE, hash_block

WINDOW = 8192                      # pages both ends remember (the decoder: 32 MiB)
LEVEL = 3                          # zstd level: keeps up with a link of a few hundred MB/s on one core
MAX_OPS = 1 << 16                  # bytes of ops in one batch
MAX_PAYLOAD = 4 << 20              # bytes of raw runs and literal pages in one batch (decompressed)
MAX_OUT = 16 << 20                 # bytes one batch makes (payload + referenced pages)
BATCH = b"B"
_HEAD = struct.Struct(">cIII")
OP_RAW, OP_PAGE, OP_REF, OP_RECENT, OP_BLOCKS, OP_DELTA = 1, 2, 3, 4, 5, 6
_U32 = struct.Struct(">I")
_RUN = struct.Struct(">BHIIQ")     # OP_BLOCKS, object number, first block, count, the second page's header
_U64 = struct.Struct(">Q")
_DELTA = struct.Struct(">BHIH")    # OP_DELTA, object number, block, the delta's length (the delta follows)


@dataclass
class Stats:
    stream_bytes: int = 0          # QEMU's stream (what would travel raw)
    wire_bytes: int = 0            # frames
    refs: int = 0                  # pages sent as references to what the destination holds
    recent: int = 0                # pages sent as the number of an earlier page of this connection
    raw_pages: int = 0             # pages sent themselves (compressed)
    runs: int = 0                  # runs of held pages sent as (object, first block, count): OP_BLOCKS
    deltas: int = 0                # pages sent as deltas against a block the destination holds: OP_DELTA

    def add(self, other: Stats) -> None:
        for k, v in other.__dict__.items():
            setattr(self, k, getattr(self, k) + v)

    @property
    def literal_bytes(self) -> int:
        """The stream's bytes less its pages that went as references or as earlier pages: what travelled itself,
        compressed — the share of the stream the link's rate bounds."""
        return self.stream_bytes - (self.refs + self.recent) * PAGE_SIZE


class Encoder:
    """The source side: :meth:`encode` each chunk QEMU wrote, :meth:`finish` at its end; :attr:`stats`."""

    def __init__(self, known: Known | None = None, *, level: int = LEVEL, window: int = WINDOW,
                 runs: bool = False, delta: bool = False) -> None:
        self.known = known if known is not None else Known()
        self.runs = runs                         # the peer decodes OP_BLOCKS: held pages go as runs of blocks
        self.similar = self.known.similar if delta else None   # ... OP_DELTA: pages like a block, as deltas
        self.stats = Stats()
        self._parser = RamStream()
        self._zstd = zstandard.ZstdCompressor(level=level).compressobj()
        self._window = window
        self._seq = 0
        self._recent: dict[bytes, int] = {}
        self._ops, self._payload, self._made = bytearray(), bytearray(), 0
        self._run: int | None = None             # the offset in _ops of the batch's open run, if any
        self._run_next = (0, 0)                  # ... the place its next page must have
        self._head = 0                           # the header (be64) the last raw run ended with: a page's own

    @property
    def parser_counts(self) -> Counts:
        """What the stream's parser found so far (where the switchover began: ``end_at``)."""
        return self._parser.counts

    def encode(self, data: bytes) -> bytes:
        self.stats.stream_bytes += len(data)
        return self._frames(self._parser.feed(data))

    def finish(self) -> bytes:
        return self._frames(self._parser.close())

    def _frames(self, items: list[tuple[int, bytes]]) -> bytes:
        out = bytearray()
        pending: bytes | None = None   # a page header that the run's next page may make implied
        for kind, data in items:
            if kind == PAGE:
                op = self._page_op(data)
                if pending is not None and isinstance(op, tuple) and op == self._run_next and \
                        self._made + PAGE_SIZE + 8 <= MAX_OUT:
                    self._extend_run()
                    pending = None
                    continue
                if pending is not None:
                    out += self._raw(pending)
                    pending = None
                if isinstance(op, tuple):
                    out += self._room(_RUN.size, 0, PAGE_SIZE)
                    self._run, self._run_next = len(self._ops), (op[0], op[1] + 1)
                    self._ops += _RUN.pack(OP_BLOCKS, op[0], op[1], 1, _next_head(self._head))
                    self.stats.runs += 1
                elif op is None:
                    out += self._room(1, PAGE_SIZE, PAGE_SIZE)
                    self._ops.append(OP_PAGE)
                    self._payload += data
                    self._run = None
                else:
                    out += self._room(len(op), 0, PAGE_SIZE)
                    self._ops += op
                    self._run = None
                self._made += PAGE_SIZE
                continue
            if pending is not None:
                out += self._raw(pending)
                pending = None
            if self._run is not None and len(data) == 8 and data == self._expected_head():
                pending = data
                continue
            out += self._raw(data)
        if pending is not None:             # a call never holds bytes back
            out += self._raw(pending)
        if self._ops:
            out += self._batch()
        self.stats.wire_bytes += len(out)
        return bytes(out)

    def _room(self, need: int, payload: int, size: int) -> bytes:
        """The batch so far as a frame if ``need`` bytes of ops and ``payload`` bytes making ``size`` do not fit."""
        if self._ops and (len(self._ops) + need > MAX_OPS or len(self._payload) + payload > MAX_PAYLOAD or
                          self._made + size > MAX_OUT):
            return self._batch()
        return b""

    def _raw(self, data: bytes) -> bytes:
        out = self._room(5, len(data), len(data))
        self._ops += bytes([OP_RAW]) + _U32.pack(len(data))
        self._payload += data
        self._made += len(data)
        self._run = None
        self._head = _page_head(data)
        return out

    def _expected_head(self) -> bytes:
        """The header the open run's next page has if it follows in guest memory: the run's own, stepped."""
        assert self._run is not None
        head = _U64.unpack_from(self._ops, self._run + 11)[0]
        return _U64.pack(head + (self._count() - 1) * PAGE_SIZE) if head else b""

    def _count(self) -> int:
        assert self._run is not None
        return _U32.unpack_from(self._ops, self._run + 7)[0]

    def _extend_run(self) -> None:
        assert self._run is not None
        self._ops[self._run + 7:self._run + 11] = _U32.pack(self._count() + 1)
        self._run_next = (self._run_next[0], self._run_next[1] + 1)
        self._made += PAGE_SIZE + 8

    def _page_op(self, page: bytes) -> bytes | tuple[int, int] | None:
        h = hash_block(page)
        seq, self._seq = self._seq, self._seq + 1
        earlier = self._recent.get(h)
        self._recent[h] = seq
        if len(self._recent) > 4 * self._window:      # forget what left the window
            self._recent = {k: v for k, v in self._recent.items() if v > seq - self._window}
        if earlier is not None and earlier > seq - self._window:
            self.stats.recent += 1
            return bytes([OP_RECENT]) + _U32.pack(earlier)
        place = self.known.place(h, self._run_next if self._run is not None else None) if self.runs else None
        if place is not None:
            self.stats.refs += 1
            return place
        if h in self.known:
            self.stats.refs += 1
            return bytes([OP_REF]) + h
        if self.similar is not None and (found := self.similar.delta_of(page)) is not None:
            obj, block, d = found
            self.stats.deltas += 1
            return _DELTA.pack(OP_DELTA, obj, block, len(d)) + d
        self.stats.raw_pages += 1
        return None

    def _batch(self) -> bytes:
        payload = bytes(self._payload)
        packed = (self._zstd.compress(payload) + self._zstd.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
                  if payload else b"")
        frame = _HEAD.pack(BATCH, len(self._ops), len(packed), len(payload)) + bytes(self._ops) + packed
        self._ops, self._payload, self._made, self._run = bytearray(), bytearray(), 0, None   # runs stay in a batch
        return frame


def _page_head(raw: bytes) -> int:
    """The header of the page a raw run comes before: the 8 bytes before the block's name (u8 length + the name),
    or its last 8 bytes (CONTINUE set); 0 if neither looks like a page's header. (A wrong guess costs a run that
    does not grow: a run grows only by headers equal to what it expects.)"""
    for n in range(1, min(256, len(raw) - 8)):
        if raw[-n - 1] == n:
            head = int.from_bytes(raw[-n - 9:-n - 1], "big")
            if head & FLAGS_MASK == F_PAGE:
                return head
    tail = int.from_bytes(raw[-8:], "big") if len(raw) >= 8 else 0
    return tail if tail & FLAGS_MASK == F_PAGE | F_CONTINUE else 0


def _next_head(head: int) -> int:
    """The header of the page after the one whose header is ``head`` in the same RAM block (0: none follows)."""
    if not head & F_PAGE:
        return 0
    return ((head & ~FLAGS_MASK) + PAGE_SIZE) | F_PAGE | F_CONTINUE


Resolve = Callable[[bytes], bytes | None]


class Decoder:
    """The destination side: :meth:`decode` each chunk of frames, :meth:`finish` at their end."""

    def __init__(self, resolve: Resolve, *, window: int = WINDOW) -> None:
        self.resolve = resolve
        self.stats = Stats()
        self._buf = bytearray()
        self._parts = PartReader("the memory stream", MAX_PAYLOAD)
        self._window = window
        self._ring: list[bytes] = []
        self._seq = 0

    def decode(self, data: bytes) -> bytes:
        self._buf += data
        self.stats.wire_bytes += len(data)
        out = bytearray()
        while len(self._buf) >= _HEAD.size:
            tag, ops_len, packed_len, out_len = _HEAD.unpack_from(self._buf)
            if tag != BATCH:
                raise IntegrityError(f"the memory stream is corrupt: a frame of type {tag!r}")
            if ops_len > MAX_OPS or out_len > MAX_PAYLOAD or packed_len > packed_bound(out_len):
                raise IntegrityError("the memory stream is corrupt: a batch beyond the codec's bounds "
                                     f"({ops_len} bytes of ops, {packed_len} bytes for {out_len} of payload)")
            end = _HEAD.size + ops_len + packed_len
            if len(self._buf) < end:
                break
            ops = bytes(self._buf[_HEAD.size:_HEAD.size + ops_len])
            packed = bytes(self._buf[_HEAD.size + ops_len:end])
            del self._buf[:end]
            out += self._apply(ops, self._payload(packed, out_len))
        self.stats.stream_bytes += len(out)
        return bytes(out)

    def finish(self) -> None:
        if self._buf:
            raise IntegrityError(f"the memory stream ended inside a frame ({len(self._buf)} bytes left over)")

    def _payload(self, packed: bytes, size: int) -> bytes:
        if not packed:
            if size:
                raise IntegrityError("the memory stream is corrupt: a batch without its payload")
            return b""
        return self._parts.part(packed, size)

    def _apply(self, ops: bytes, payload: bytes) -> bytes:
        plan: list[tuple[int, int | bytes]] = []
        made = at = pos = 0
        while pos < len(ops):
            op = ops[pos]
            if op == OP_RAW and pos + 5 <= len(ops):
                n = _U32.unpack_from(ops, pos + 1)[0]
                plan.append((op, n))
                at, pos = at + n, pos + 5
                made += n
            elif op == OP_PAGE:
                plan.append((op, PAGE_SIZE))
                at, pos, made = at + PAGE_SIZE, pos + 1, made + PAGE_SIZE
            elif op == OP_REF and pos + 1 + HASH_SIZE <= len(ops):
                plan.append((op, ops[pos + 1:pos + 1 + HASH_SIZE]))
                pos, made = pos + 1 + HASH_SIZE, made + PAGE_SIZE
            elif op == OP_RECENT and pos + 5 <= len(ops):
                plan.append((op, _U32.unpack_from(ops, pos + 1)[0]))
                pos, made = pos + 5, made + PAGE_SIZE
            elif op == OP_DELTA and pos + _DELTA.size <= len(ops) and \
                    pos + _DELTA.size + (n := _DELTA.unpack_from(ops, pos)[3]) <= len(ops):
                plan.append((op, ops[pos:pos + _DELTA.size + n]))
                pos, made = pos + _DELTA.size + n, made + PAGE_SIZE
            elif op == OP_BLOCKS and pos + _RUN.size <= len(ops):
                count, head = _RUN.unpack_from(ops, pos)[3:]
                if count == 0 or count > 1 and (not head & F_PAGE or head + (count - 2) * PAGE_SIZE >= 1 << 64):
                    raise IntegrityError("the memory stream is corrupt: a run of no blocks, or without its headers")
                plan.append((op, ops[pos:pos + _RUN.size]))
                pos, made = pos + _RUN.size, made + count * (PAGE_SIZE + 8) - 8
            else:
                raise IntegrityError(f"the memory stream is corrupt: an op {op:#x} the codec does not know, or cut")
            if at > len(payload) or made > MAX_OUT:
                raise IntegrityError("the memory stream is corrupt: a batch that asks for more than it carries")
        if at != len(payload):
            raise IntegrityError("the memory stream is corrupt: a batch whose payload is longer than its ops")
        out, at = bytearray(), 0
        for op, arg in plan:
            if op == OP_RAW:
                assert isinstance(arg, int)
                out += payload[at:at + arg]
                at += arg
                continue
            if op == OP_PAGE:
                page = payload[at:at + PAGE_SIZE]
                at += PAGE_SIZE
                self.stats.raw_pages += 1
            elif op == OP_REF:
                assert isinstance(arg, bytes)
                page = self._resolved(arg)
                self.stats.refs += 1
            elif op == OP_DELTA:
                assert isinstance(arg, bytes)
                obj, block = _DELTA.unpack_from(arg)[1:3]
                page = undelta(arg[_DELTA.size:], self._blocks(obj, block, 1)[0])
                self.stats.deltas += 1
            elif op == OP_BLOCKS:
                assert isinstance(arg, bytes)
                obj, first, count, head = _RUN.unpack(arg)[1:]
                for i, page in enumerate(self._run_of(obj, first, count)):
                    if i:
                        out += _U64.pack(head + (i - 1) * PAGE_SIZE)
                    self._remember(page)
                    out += page
                continue
            else:
                assert isinstance(arg, int)
                if not self._seq - min(self._seq, self._window) <= arg < self._seq:
                    raise IntegrityError(f"the memory stream refers to page {arg}, which this end does not hold "
                                         f"(it holds pages {max(0, self._seq - self._window)}..{self._seq - 1})")
                page = self._ring[arg % self._window]
                self.stats.recent += 1
            self._remember(page)
            out += page
        return bytes(out)

    def _blocks(self, obj: int, first: int, count: int) -> list[bytes]:
        blocks = getattr(self.resolve, "blocks", None)
        if blocks is None:
            raise IntegrityError("the memory stream names blocks by their place, which this end does not resolve")
        return list(blocks(obj, first, count))

    def _run_of(self, obj: int, first: int, count: int) -> list[bytes]:
        pages = self._blocks(obj, first, count)
        self.stats.refs += count
        self.stats.runs += 1
        return pages

    def _resolved(self, h: bytes) -> bytes:
        page = self.resolve(h)
        if page is None:
            raise IntegrityError(f"the memory stream refers to block {h.hex()}, which this host does not hold: "
                                 "the move fails and the guest runs on at the source")
        if len(page) != PAGE_SIZE or hash_block(page) != h:
            raise IntegrityError(f"block {h.hex()} read here does not have that hash: refused (the memory "
                                 "stream is not rebuilt from it)")
        return bytes(page)

    def _remember(self, page: bytes) -> None:
        if len(self._ring) < self._window:
            self._ring.append(page)
        else:
            self._ring[self._seq % self._window] = page
        self._seq += 1
