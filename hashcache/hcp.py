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

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import zstandard

from hashcache.blocks import BLOCK_SIZE, hash_block
from hashcache.errors import HashcacheError, ManifestMismatch
from hashcache.manifest import RECORD_SIZE, Manifest
from hashcache.shadow import Shadow

MAX_BATCH = 1024            # blocks per READ / upload batch
DEFAULT_BATCH = 256         # 1 MiB of raw data per request
DEFAULT_LEVEL = 3


class ProtocolError(HashcacheError):
    """A peer sent something malformed."""


class BlockLookup(Protocol):
    """What a receiver needs from a hash cache: verified data for a hash, or None."""

    def lookup(self, digest: bytes) -> bytes | None: ...


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


def pack_blocks(blocks: Iterable[bytes], level: int = DEFAULT_LEVEL, compress: bool = True) -> bytes:
    raw = b"".join(blocks)
    if not compress:
        return raw
    return zstandard.ZstdCompressor(level=level).compress(raw)


def unpack_blocks(payload: bytes, count: int, compressed: bool = True) -> list[bytes]:
    """Split a READ payload into ``count`` blocks; a payload that does not
    decompress to exactly ``count`` blocks is a protocol error."""
    want = count * BLOCK_SIZE
    if compressed:
        try:
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=want)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"bad zstd payload: {exc}") from exc
    else:
        raw = payload
    if len(raw) != want:
        raise ProtocolError(f"payload holds {len(raw)} bytes, expected {count} blocks")
    mv = memoryview(raw)
    return [bytes(mv[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]) for i in range(count)]


def manifest_from_parts(header: dict, records: bytes, expected_digest: str) -> Manifest:
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


def header_of(m: Manifest) -> dict:
    return {"kind": m.kind, "algorithm": m.algorithm, "block_size": m.block_size, "size": m.size,
            "parent": m.parent, "count": len(m), "digest": m.digest, "stored_bytes": m.stored_bytes}


def records_chunks(count: int, chunk: int = 65536) -> list[tuple[int, int]]:
    return [(s, min(chunk, count - s)) for s in range(0, count, chunk)]


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

    def __init__(self, manifest: Manifest, shadow: Shadow, name: str, cache: BlockLookup | None = None,
                 stats: TransferStats | None = None, dedupe: bool = True) -> None:
        if shadow.nblocks < manifest.block_count:
            raise ValueError("shadow is smaller than the object")
        self.manifest = manifest
        self.shadow = shadow
        self.name = name
        self.cache = cache
        self.stats = stats or TransferStats()
        self._nonzero = [i for i, z, _h in manifest.records() if not z]
        self._by_hash: dict[bytes, list[int]] | None = None if dedupe else {}
        self.stats.raw_bytes = len(self._nonzero) * BLOCK_SIZE

    def _duplicates(self) -> dict[bytes, list[int]]:
        """hash → every data block index with that hash (a memory image repeats many pages)."""
        if self._by_hash is None:
            by: dict[bytes, list[int]] = {}
            for i, z, h in self.manifest.records():
                if not z:
                    by.setdefault(h, []).append(i)
            self._by_hash = {h: ix for h, ix in by.items() if len(ix) > 1}
        return self._by_hash

    def plan(self, on_progress: Callable[[int], None] | None = None) -> list[int]:
        """Blocks still to fetch: not in the shadow (resume), not in the hash
        cache, and one block per distinct hash (repeats are copied locally)."""
        missing = self.shadow.missing(self._nonzero)
        self.stats.resumed_bytes = (len(self._nonzero) - len(missing)) * BLOCK_SIZE
        still: list[int] = []
        seen: set[bytes] = set()
        batch: list[tuple[int, bytes]] = []
        for index in missing:
            h = self.manifest.hash_of(index)
            assert h is not None
            if h in seen and self._duplicates():
                continue  # a repeat of a block we will fetch: copied when it arrives
            seen.add(h)
            data = self.cache.lookup(h) if self.cache is not None else None
            if data is not None and len(data) == BLOCK_SIZE and hash_block(data) == h:
                batch.append((index, data))
                batch.extend((j, data) for j in self._duplicates().get(h, ()) if j != index
                             and not self.shadow.has(j))
                if len(batch) >= DEFAULT_BATCH:
                    self._store(batch, "cache_bytes", on_progress)
                    batch = []
            else:
                still.append(index)
        self._store(batch, "cache_bytes", on_progress)
        return still

    def _store(self, batch: list[tuple[int, bytes]], counter: str,
               on_progress: Callable[[int], None] | None) -> None:
        if not batch:
            return
        self.shadow.store(batch)
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
            for index, data in zip(indices, blocks, strict=True):
                rec = self.manifest.record(index)
                if rec is None or rec[0]:
                    raise ProtocolError(f"{self.name}: block {index} is not a data block of this object")
                if hash_block(data) != rec[1]:
                    raise ManifestMismatch(f"{self.name}: block {index} does not match its manifest hash",
                                           object_name=self.name, block=index)
                good.append((index, data))
        finally:
            self._store(good, "fetched_bytes", on_progress)
            dups = self._duplicates()
            copies = [(j, data) for index, data in good for j in dups.get(self.manifest.hash_of(index) or b"", ())
                      if j != index and not self.shadow.has(j)]
            self._store(copies, "cache_bytes", on_progress)

    def complete(self) -> bool:
        return not self.shadow.missing(self._nonzero)

    def nonzero_indices(self) -> list[int]:
        return list(self._nonzero)


__all__ = [
    "RECORD_SIZE", "BlockLookup", "ProtocolError", "Receiver", "TransferStats", "decode_indices",
    "encode_indices", "header_of", "manifest_from_parts", "pack_blocks", "records_chunks", "unpack_blocks",
]
