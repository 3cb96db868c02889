"""HCP deltas: a block the receiver lacks, sent as a zstd delta against similar blocks it already holds.

A pushed layer is a child of a parent layer the receiver holds, and most of its novel blocks are small
changes of blocks of that parent (a file a package update rewrote, an inode table). The sender names
such *reference* blocks by where they lie in the disk the parent layer shows (its chain of layers, which
the receiver holds: it takes no layer before its parent) and sends the new blocks as one zstd frame
compressed with the references' bytes as a raw-content dictionary (``zstd --patch-from``). The receiver
reads the references from its own copy of the parent chain, rebuilds the blocks, checks each one's hash
against the manifest — as every block — and keeps them whole; a delta whose result does not match is
refused naming the block, and nothing of its upload is written. References it cannot read (no parent
chain here) leave the delta's blocks *unresolved*: they are not kept, and the sender sends them again
whole (it asks which blocks the receiver lacks, as after a lost answer).

Advertised by the receiver: ``DELTAS_HEADER`` (``X-Capsule-Deltas``) on ``begin``'s answer names the delta
format versions it decodes (``1``); a sender sends deltas only to a receiver that names ``1``, so an older
receiver gets every block whole.

Upload (``POST /v1/recv/{kind}/{id}/blocks?delta=1``): the usual envelope — u32 ``n``, ``n`` bytes of
ascending block indices as varints (every block upload's) — then delta records, until the payload ends.
Each record rebuilds some of the envelope's blocks (together, every one of them exactly once)::

    u16     i           bytes of the record's block indices
    i       indices     its k blocks' indices: ascending varints, as in the envelope (1..MAX_BATCH of them)
    u16     r           runs of references, 1..MAX_REFS
    r x 10  runs        u64 first block, u16 count (>= 1): blocks of the disk the object's parent layer
                        shows, in dictionary order (the most similar last: zstd finds near matches cheaper
                        at a dictionary's end); MAX_REFS blocks at most in all, each within that disk
    u32     m           bytes of the frame, 1..k x 4096 + 1024 (little-endian, as every integer here)
    m       frame       one zstd frame that declares its content size, k x 4096, and decompresses to the
                        k blocks in index order, with the r references concatenated in order as its
                        raw-content dictionary

The sender makes one record per block (a block against the parent's block at the same disk offset) or
one per changed file (its new blocks against the old file's: a rebuilt
library shifts code by more than a block, which only the whole old file finds; on libsystemd-shared
252 → 254, 3.6 MB: 0.84 MB as one delta against the old file, 1.24 MB as xz, 1.69 MB as per-block
deltas). Bounds on what the receiver takes: at most ``MAX_BATCH`` blocks (the envelope's bound), at most
``MAX_REFS`` reference blocks a record (a dictionary of at most 8 MiB) and ``MAX_UPLOAD_REFS`` an upload, a
frame of at most its blocks' bytes + 1 KiB, an output of exactly its blocks (a frame declaring more is
refused from its header, before any allocation); anything else is a ProtocolError and nothing is kept.
Answer: ``{"stored": kept, "rebuilt": kept, "unresolved": blocks whose references were not found here}``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zstandard

from hashcache.blocks import BLOCK_SIZE, hash_block
from hashcache.errors import ManifestMismatch
from hashcache.hcp import MAX_BATCH, ProtocolError, decode_indices, encode_indices

DELTAS_HEADER = "X-Capsule-Deltas"   # on begin's answer: the delta formats this receiver decodes
DELTA_FORMAT = "1"
MAX_REFS = 2048                      # reference blocks of one record: 8 MiB of dictionary (xz's default window)
MAX_UPLOAD_REFS = 4 * MAX_REFS       # reference blocks named by one upload's records together
FRAME_SLACK = 1024                   # a frame may exceed its blocks' bytes by this much (incompressible data)
DELTA_LEVEL = 19
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_RUN = struct.Struct("<QH")


def offered(header: str | None) -> bool:
    """Whether a receiver's ``DELTAS_HEADER`` says it decodes this module's deltas."""
    return DELTA_FORMAT in {v.strip() for v in (header or "").split(",")}


Runs = tuple[tuple[int, int], ...]   # (first block, count) of the parent chain's disk


def runs_of(refs: Sequence[int]) -> Runs:
    """Reference block numbers, in dictionary order, as runs of consecutive ones."""
    out: list[list[int]] = []
    for b in refs:
        if out and out[-1][0] + out[-1][1] == b and out[-1][1] < 0xFFFF:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return tuple((a, n) for a, n in out)


def blocks_of(runs: Runs) -> list[int]:
    return [a + k for a, n in runs for k in range(n)]


@dataclass(frozen=True)
class Delta:
    """Blocks as one delta: their indices (ascending), the runs of the parent chain's blocks it is against
    (in dictionary order) and the zstd frame."""

    indices: tuple[int, ...]
    refs: Runs
    frame: bytes

    @property
    def ref_count(self) -> int:
        return sum(n for _a, n in self.refs)

    @property
    def wire_size(self) -> int:
        return 2 * _U16.size + len(encode_indices(self.indices)) + len(self.refs) * _RUN.size + _U32.size + len(
            self.frame)


def _dictionary(refs: Sequence[bytes]) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(b"".join(refs), dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def encode(indices: Sequence[int], blocks: Sequence[bytes], refs: Sequence[int], ref_blocks: Sequence[bytes],
           level: int = DELTA_LEVEL) -> Delta:
    """``blocks`` (4 KiB each, at ``indices``, ascending) as one delta against the parent chain's blocks
    ``refs`` (whose bytes are ``ref_blocks``; dictionary order, the most similar last)."""
    if not 1 <= len(blocks) <= MAX_BATCH or len(indices) != len(blocks) or any(len(b) != BLOCK_SIZE for b in blocks) \
            or not 1 <= len(refs) <= MAX_REFS or len(ref_blocks) != len(refs) \
            or any(len(r) != BLOCK_SIZE for r in ref_blocks):
        raise ValueError(f"a delta rebuilds 1 to {MAX_BATCH} {BLOCK_SIZE}-byte blocks from 1 to {MAX_REFS} such "
                         "blocks")
    encode_indices(indices)   # ascending, or a ValueError
    cctx = zstandard.ZstdCompressor(level=level, dict_data=_dictionary(ref_blocks), write_content_size=True,
                                    write_checksum=False, write_dict_id=False)
    return Delta(tuple(indices), runs_of(refs), cctx.compress(b"".join(blocks)))


def rebuild(delta: Delta, refs: Sequence[bytes]) -> list[bytes]:
    """The blocks ``delta`` rebuilds from its references' bytes ``refs``; a frame that is not exactly their
    bytes (bad zstd, a declared or actual size other than theirs) is a ProtocolError."""
    want = len(delta.indices) * BLOCK_SIZE
    try:
        declared = zstandard.frame_content_size(delta.frame)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"bad delta frame: {exc}") from exc
    if declared != want:
        raise ProtocolError(f"a delta frame of {len(delta.indices)} blocks must declare {want} bytes, this one "
                            f"declares {declared}")
    try:
        out = zstandard.ZstdDecompressor(dict_data=_dictionary(refs)).decompress(delta.frame, max_output_size=want)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"bad delta frame: {exc}") from exc
    if len(out) != want:
        raise ProtocolError(f"a delta frame gave {len(out)} bytes, not {want}")
    return [out[k:k + BLOCK_SIZE] for k in range(0, want, BLOCK_SIZE)]


def pack(deltas: Sequence[Delta]) -> bytes:
    """The delta records of an upload (the envelope's indices: every record's, merged)."""
    out = bytearray()
    for d in deltas:
        idx = encode_indices(d.indices)
        if not 1 <= d.ref_count <= MAX_REFS or not 1 <= len(d.frame) <= len(d.indices) * BLOCK_SIZE + FRAME_SLACK \
                or len(idx) > 0xFFFF:
            raise ValueError("a delta out of bounds")
        out += _U16.pack(len(idx)) + idx + _U16.pack(len(d.refs)) + b"".join(_RUN.pack(a, n) for a, n in d.refs)
        out += _U32.pack(len(d.frame))
        out += d.frame
    return bytes(out)


def unpack(payload: bytes, indices: Sequence[int], disk_blocks: int) -> list[Delta]:
    """The delta records of an upload whose envelope names ``indices`` (a peer's: every length checked
    before it is used; together the records must rebuild each of ``indices`` exactly once; every reference
    within the parent's disk of ``disk_blocks`` blocks)."""
    out: list[Delta] = []
    pos = 0
    wanted = set(indices)
    if len(wanted) != len(indices):
        raise ProtocolError("a delta upload names a block twice")
    limit = max(indices, default=-1) + 1
    named = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if pos + n > len(payload):
            raise ProtocolError(f"delta upload truncated in {what} of record {len(out)}")
        pos += n
        return payload[pos - n:pos]

    while pos < len(payload):
        (i,) = _U16.unpack(take(_U16.size, "its index length"))
        mine = decode_indices(take(i, "its indices"), limit)
        if not mine or not set(mine) <= wanted:
            raise ProtocolError(f"delta record {len(out)} names blocks the upload does not, or none, or one twice")
        wanted.difference_update(mine)
        (r,) = _U16.unpack(take(_U16.size, "its reference count"))
        raw = take(r * _RUN.size, "its references")
        refs = tuple(_RUN.unpack_from(raw, k * _RUN.size) for k in range(r))
        count = sum(n for _a, n in refs)
        named += count
        if not 1 <= count <= MAX_REFS or named > MAX_UPLOAD_REFS or any(n < 1 for _a, n in refs):
            raise ProtocolError(f"a delta names {count} reference blocks in {r} runs (1 to {MAX_REFS}, "
                                f"{MAX_UPLOAD_REFS} in one upload)")
        if any(a + n > disk_blocks for a, n in refs):
            raise ProtocolError(f"a delta names reference blocks beyond the parent's disk of {disk_blocks} blocks")
        (m,) = _U32.unpack(take(_U32.size, "its frame length"))
        if not 1 <= m <= len(mine) * BLOCK_SIZE + FRAME_SLACK:
            raise ProtocolError(f"a delta frame of {m} bytes for {len(mine)} blocks (1 to "
                                f"{len(mine) * BLOCK_SIZE + FRAME_SLACK})")
        out.append(Delta(tuple(mine), refs, take(m, "its frame")))
    if wanted:
        raise ProtocolError(f"{len(wanted)} blocks of the delta upload are in none of its records")
    return out


Read = Callable[[int], "bytes | None"]   # a block of the parent chain's disk (None: it cannot be read here)


def rebuild_all(name: str, deltas: Sequence[Delta], read: Read,
                expected: Callable[[int], bytes]) -> tuple[list[tuple[int, bytes]], list[int]]:
    """Rebuild an upload's blocks: (verified blocks to keep, indices left unresolved — a reference ``read``
    could not read). ``expected(index)`` is the block's manifest hash (or its prefix). Every block is
    checked before any is returned: one that does not match raises ManifestMismatch naming ``name`` and
    the block, and the caller keeps nothing of the upload."""
    good: list[tuple[int, bytes]] = []
    unresolved: list[int] = []
    for delta in deltas:
        refs: list[bytes] = []   # one record's references at a time: at most 8 MiB
        for b in blocks_of(delta.refs):
            data = read(b)
            if data is None or len(data) != BLOCK_SIZE:
                break
            refs.append(data)
        if len(refs) != delta.ref_count:
            unresolved.extend(delta.indices)
            continue
        for index, block in zip(delta.indices, rebuild(delta, refs), strict=True):
            want = expected(index)
            if hash_block(block)[:len(want)] != want:
                raise ManifestMismatch(f"{name}: block {index} rebuilt from its delta does not match its manifest "
                                       "hash; nothing of this upload was kept", object_name=name, block=index)
            good.append((index, block))
    return sorted(good), sorted(unresolved)


__all__ = ["DELTAS_HEADER", "DELTA_FORMAT", "MAX_REFS", "Delta", "blocks_of", "encode", "offered", "pack", "rebuild",
           "rebuild_all", "runs_of", "unpack"]
