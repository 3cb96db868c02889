"""B4's "after hashing" accounting: which 4 KiB blocks of a snapshot are new.

A block counts once: a snapshot's new bytes are its distinct non-zero blocks whose content appears in
nothing before it (the image the capsule started from, every earlier snapshot's memory and disk, and the
objects of this snapshot already counted). Within a snapshot the memory image is counted first, then the
disks, the order HCP sends them in; so a disk block whose content is also in this snapshot's memory is
counted with the memory. The blocks are named by their BLAKE3 hashes (the manifests Capsule keeps)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import zstandard

BLOCK = 4096


@dataclass
class NewBlocks:
    """The new blocks of one object: the index of one block per new content, in block order."""

    label: str
    indices: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return len(self.indices) * BLOCK


class Seen:
    """Every block content counted so far."""

    def __init__(self, hashes: Iterable[bytes] = ()) -> None:
        self._hashes: set[bytes] = set(hashes)

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, h: bytes) -> bool:
        return h in self._hashes

    def add_known(self, records: Iterable[tuple[int, bool, bytes]]) -> None:
        """Know the non-zero blocks of an object without counting them (the starting image)."""
        self._hashes.update(h for _i, zero, h in records if not zero)

    def take(self, label: str, records: Iterable[tuple[int, bool, bytes]]) -> NewBlocks:
        """Count an object's blocks (``(index, zero, hash)`` as a manifest lists them): return the ones
        never seen, one per content, and remember them."""
        new = NewBlocks(label)
        for index, zero, h in records:
            if zero or h in self._hashes:
                continue
            self._hashes.add(h)
            new.indices.append(index)
        return new


@dataclass
class Compressed:
    raw: int = 0
    zstd: int = 0
    gzip: int = 0


def compressed_sizes(chunks: Iterator[bytes], zstd_level: int = 3, gzip_level: int = 6) -> Compressed:
    """The bytes of ``chunks`` concatenated, raw, as one zstd frame (``zstd -3``) and as one gzip
    stream (``gzip -6``, the paper's measure)."""
    out = Compressed()
    z = zstandard.ZstdCompressor(level=zstd_level).compressobj()
    g = zlib.compressobj(gzip_level, zlib.DEFLATED, 31)
    for chunk in chunks:
        out.raw += len(chunk)
        out.zstd += len(z.compress(chunk))
        out.gzip += len(g.compress(chunk))
    out.zstd += len(z.flush())
    out.gzip += len(g.flush())
    return out


def allocated_bytes(extents: Iterable[dict[str, object]]) -> int:
    """Bytes holding data in an image itself (``qemu-img map --output=json`` extents at depth 0 with
    data, not reading as zero): what a backup increment actually stores."""
    return sum(int(e["length"]) for e in extents  # type: ignore[call-overload]
               if e.get("depth") == 0 and e.get("data") and not e.get("zero"))
