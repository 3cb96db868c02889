"""HCP deltas: a block the receiver lacks, sent as a zstd delta against similar blocks it already holds.

A pushed layer is a child of a parent layer the receiver holds, and most of its novel blocks are small
changes of blocks of that parent (a file a package update rewrote, an inode table). The sender names a
few such *reference* blocks by their BLAKE3 hash and sends the new block as one zstd frame compressed
with the references' bytes as a raw-content dictionary (``zstd --patch-from``). The receiver finds the
references in its hash cache, rebuilds the block, checks its hash against the manifest — as every block —
and keeps it whole; a delta whose result does not match is refused naming the block, and nothing of its
upload is written. A reference the receiver cannot find leaves that block *unresolved*: it is not kept, and
the sender sends it again whole (it asks which blocks the receiver lacks, as after a lost answer).

Advertised by the receiver: ``DELTAS_HEADER`` (``X-Capsule-Deltas``) on ``begin``'s answer names the delta
format versions it decodes (``1``); a sender sends deltas only to a receiver that names ``1``, so an older
receiver gets every block whole.

Upload (``POST /v1/recv/{kind}/{id}/blocks?delta=1``): the usual envelope — u32 ``n``, ``n`` bytes of
ascending block indices as varints (as every block upload) — then per index, in order, one delta record::

    u8      r           references, 1..MAX_REFS
    r x 8   refs        hash prefixes (the first 8 bytes of BLAKE3) of 4 KiB blocks the receiver holds,
                        most similar last (zstd finds near matches cheaper at the end of a dictionary)
    u16     m           bytes of the frame, 1..MAX_DELTA_BYTES (little-endian, as every integer here)
    m       frame       one zstd frame that declares its content size, 4096, and decompresses to exactly
                        that with the r reference blocks concatenated in order as raw-content dictionary

Nothing else follows the last record. Bounds on what the receiver takes: at most ``MAX_BATCH`` records
(the indices' bound), at most ``MAX_REFS`` references (a dictionary of at most 16 KiB), a frame of at
most ``MAX_DELTA_BYTES``, an output of exactly one block (a frame declaring more is refused from its
header, before any allocation); anything else is a ProtocolError and nothing is kept. Answer:
``{"stored": kept, "rebuilt": kept, "unresolved": blocks whose references were not found}``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zstandard

from hashcache.blocks import BLOCK_SIZE, hash_block
from hashcache.errors import ManifestMismatch
from hashcache.hcp import PREFIX_SIZE, ProtocolError

DELTAS_HEADER = "X-Capsule-Deltas"   # on begin's answer: the delta formats this receiver decodes
DELTA_FORMAT = "1"
MAX_REFS = 4
REF_SIZE = PREFIX_SIZE               # a reference is named by the first 8 bytes of its hash
MAX_DELTA_BYTES = BLOCK_SIZE + 64    # a delta larger than the block it rebuilds is never sent
DELTA_LEVEL = 19                     # ~0.2 ms a block: deltas are few, their bytes matter on a slow link
_HEAD = struct.Struct("<B")
_LEN = struct.Struct("<H")


def offered(header: str | None) -> bool:
    """Whether a receiver's ``DELTAS_HEADER`` says it decodes this module's deltas."""
    return DELTA_FORMAT in {v.strip() for v in (header or "").split(",")}


@dataclass(frozen=True)
class Delta:
    """One block as a delta: the hash prefixes of its references (most similar last) and the zstd frame."""

    refs: tuple[bytes, ...]
    frame: bytes

    @property
    def wire_size(self) -> int:
        return _HEAD.size + len(self.refs) * REF_SIZE + _LEN.size + len(self.frame)


def _dictionary(refs: Sequence[bytes]) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(b"".join(refs), dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def encode(block: bytes, refs: Sequence[bytes], level: int = DELTA_LEVEL) -> Delta:
    """``block`` (4 KiB) as a delta against the blocks ``refs`` (4 KiB each, most similar last)."""
    if len(block) != BLOCK_SIZE or not 1 <= len(refs) <= MAX_REFS or any(len(r) != BLOCK_SIZE for r in refs):
        raise ValueError(f"a delta rebuilds one {BLOCK_SIZE}-byte block from 1 to {MAX_REFS} such blocks")
    cctx = zstandard.ZstdCompressor(level=level, dict_data=_dictionary(refs), write_content_size=True,
                                    write_checksum=False, write_dict_id=False)
    return Delta(tuple(hash_block(r)[:REF_SIZE] for r in refs), cctx.compress(block))


def rebuild(delta: Delta, refs: Sequence[bytes]) -> bytes:
    """The block ``delta`` rebuilds from its references' bytes ``refs``; a frame that is not one block's
    delta (bad zstd, a declared or actual size other than 4096) is a ProtocolError."""
    try:
        declared = zstandard.frame_content_size(delta.frame)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"bad delta frame: {exc}") from exc
    if declared != BLOCK_SIZE:
        raise ProtocolError(f"a delta frame must declare {BLOCK_SIZE} bytes, this one declares {declared}")
    try:
        out = zstandard.ZstdDecompressor(dict_data=_dictionary(refs)).decompress(delta.frame,
                                                                                  max_output_size=BLOCK_SIZE)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"bad delta frame: {exc}") from exc
    if len(out) != BLOCK_SIZE:
        raise ProtocolError(f"a delta frame gave {len(out)} bytes, not {BLOCK_SIZE}")
    return out


def pack(deltas: Sequence[Delta]) -> bytes:
    """The delta records of an upload, in the order of its indices."""
    out = bytearray()
    for d in deltas:
        if not 1 <= len(d.refs) <= MAX_REFS or not 1 <= len(d.frame) <= MAX_DELTA_BYTES:
            raise ValueError("a delta out of bounds")
        out += _HEAD.pack(len(d.refs)) + b"".join(d.refs) + _LEN.pack(len(d.frame)) + d.frame
    return bytes(out)


def unpack(payload: bytes, count: int) -> list[Delta]:
    """Exactly ``count`` delta records (a peer's: every length checked before it is used)."""
    out: list[Delta] = []
    pos = 0
    mv = memoryview(payload)
    for k in range(count):
        if pos + _HEAD.size > len(payload):
            raise ProtocolError(f"delta upload truncated at record {k} of {count}")
        (r,) = _HEAD.unpack_from(payload, pos)
        if not 1 <= r <= MAX_REFS:
            raise ProtocolError(f"a delta names {r} references (1 to {MAX_REFS})")
        pos += _HEAD.size
        end = pos + r * REF_SIZE + _LEN.size
        if end > len(payload):
            raise ProtocolError(f"delta upload truncated at record {k} of {count}")
        refs = tuple(bytes(mv[pos + i * REF_SIZE:pos + (i + 1) * REF_SIZE]) for i in range(r))
        (m,) = _LEN.unpack_from(payload, end - _LEN.size)
        if not 1 <= m <= MAX_DELTA_BYTES:
            raise ProtocolError(f"a delta frame of {m} bytes (1 to {MAX_DELTA_BYTES})")
        if end + m > len(payload):
            raise ProtocolError(f"delta upload truncated at record {k} of {count}")
        out.append(Delta(refs, bytes(mv[end:end + m])))
        pos = end + m
    if pos != len(payload):
        raise ProtocolError(f"{len(payload) - pos} bytes after the last of {count} delta records")
    return out


Lookup = Callable[[bytes], "tuple[bytes, bytes] | None"]   # a hash prefix -> (block, full hash), verified


def rebuild_all(name: str, indices: Sequence[int], deltas: Sequence[Delta], lookup: Lookup,
                expected: Callable[[int], bytes]) -> tuple[list[tuple[int, bytes]], list[int]]:
    """Rebuild an upload's blocks: (verified blocks to keep, indices left unresolved — a reference not
    found by ``lookup``). ``expected(index)`` is the block's manifest hash (or its prefix). Every block is
    checked before any is returned: one that does not match raises ManifestMismatch naming ``name`` and
    the block, and the caller keeps nothing of the upload."""
    found: dict[bytes, bytes | None] = {}
    good: list[tuple[int, bytes]] = []
    unresolved: list[int] = []
    for index, delta in zip(indices, deltas, strict=True):
        refs: list[bytes] = []
        for prefix in delta.refs:
            if prefix not in found:
                hit = lookup(prefix)
                ok = hit is not None and len(hit[0]) == BLOCK_SIZE and hit[1][:REF_SIZE] == prefix
                found[prefix] = hit[0] if ok and hit is not None else None
            data = found[prefix]
            if data is None:
                break
            refs.append(data)
        if len(refs) != len(delta.refs):
            unresolved.append(index)
            continue
        block = rebuild(delta, refs)
        want = expected(index)
        if hash_block(block)[:len(want)] != want:
            raise ManifestMismatch(f"{name}: block {index} rebuilt from its delta does not match its manifest "
                                   "hash; nothing of this upload was kept", object_name=name, block=index)
        good.append((index, block))
    return good, unresolved


__all__ = ["DELTAS_HEADER", "DELTA_FORMAT", "MAX_DELTA_BYTES", "MAX_REFS", "REF_SIZE", "Delta", "encode", "offered",
           "pack", "rebuild", "rebuild_all", "unpack"]
