"""Pages a live move's memory codec sends as deltas against a similar block both hosts hold (``ramdedup``'s
OP_DELTA, to a peer naming :data:`FEATURE`).

The kernel a guest runs is the unpacked kernel (:mod:`kernelimage`) with its relocations applied: under KASLR
most of its code differs from the file in a few bytes a page, so neither a hash nor a run finds it, and zstd
alone makes 2.2 KB of each such page. Against the unpacked kernel's block at the same place it is a few hundred
bytes: B2-live's tiny guest sent 2,947 pages as 0.8 MB where zstd made 6.2 MB of them.

- :class:`Similar` (source): an index of the blocks of objects held in memory on both hosts (the unpacked
  kernel), by :data:`SPOTS` windows of :data:`WINDOW` bytes at fixed places in each block (Finesse's idea of
  features, with the place kept: a relocated page keeps its layout). A page's candidate is the block most of its
  windows name; its delta is zstd with that block as the dictionary (:func:`delta`), kept if at most
  :data:`MAX_DELTA` bytes.
- :func:`undelta` (destination): the page again from the delta and the block, read there and checked against
  its manifest first; the delta carries zstd's checksum of the page, so a wrong block or a corrupt delta fails
  the move (:class:`~capsule.errors.IntegrityError`) instead of making a wrong page."""

from __future__ import annotations

from collections import Counter

import zstandard

from capsule.errors import IntegrityError
from hashcache.blocks import BLOCK_SIZE

FEATURE = "memory-delta"
WINDOW = 16                           # bytes in a window
SPOTS = range(0, BLOCK_SIZE, 512)     # where the windows are in a block: 8 of them
MAX_DELTA = 1536                      # a delta larger than this is not worth it: the page goes compressed
LEVEL = 3


class Similar:
    """Blocks of objects held in memory, by their windows (see the module's text)."""

    def __init__(self) -> None:
        self._index: dict[bytes, int] = {}          # spot (u16) + window → object << 32 | block
        self._objects: dict[int, bytes] = {}

    def add(self, obj: int, data: bytes) -> None:
        """Index the blocks of ``data``, the object numbered ``obj`` in the move."""
        self._objects[obj] = data
        index = self._index
        for b in range(len(data) // BLOCK_SIZE):
            at = b * BLOCK_SIZE
            for spot in SPOTS:
                window = data[at + spot:at + spot + WINDOW]
                if _varied(window):
                    index.setdefault(spot.to_bytes(2, "big") + window, obj << 32 | b)

    def __bool__(self) -> bool:
        return bool(self._index)

    def find(self, page: bytes) -> tuple[int, int] | None:
        """The block most of ``page``'s windows name: (object, block), or None."""
        votes = Counter(self._index.get(spot.to_bytes(2, "big") + page[spot:spot + WINDOW]) for spot in SPOTS)
        votes.pop(None, None)
        if not votes:
            return None
        best = votes.most_common(1)[0][0]
        assert best is not None
        return best >> 32, best & 0xFFFF_FFFF

    def block(self, obj: int, block: int) -> bytes:
        return self._objects[obj][block * BLOCK_SIZE:(block + 1) * BLOCK_SIZE].ljust(BLOCK_SIZE, b"\0")

    def delta_of(self, page: bytes) -> tuple[int, int, bytes] | None:
        """(object, block, delta) for a page worth sending as a delta, else None."""
        place = self.find(page)
        if place is None:
            return None
        d = delta(page, self.block(*place))
        return (*place, d) if len(d) <= MAX_DELTA else None


def _varied(window: bytes) -> bool:
    """A window worth indexing: not padding (a few distinct bytes name far too many blocks)."""
    return len(window) == WINDOW and len(set(window)) > 4


def _dict(ref: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(ref, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def delta(page: bytes, ref: bytes) -> bytes:
    """``page`` as zstd against ``ref`` (the dictionary), with the page's checksum."""
    return zstandard.ZstdCompressor(level=LEVEL, dict_data=_dict(ref), write_checksum=True).compress(page)


def undelta(data: bytes, ref: bytes) -> bytes:
    """The page a :func:`delta` against ``ref`` makes; IntegrityError unless it is exactly a page, checksum
    checked."""
    try:
        if zstandard.frame_content_size(data) not in (BLOCK_SIZE, -1):     # (else it would be allocated so)
            raise IntegrityError("the memory stream is corrupt: a page's delta says it makes more than a page")
        page = zstandard.ZstdDecompressor(dict_data=_dict(ref)).decompress(data, max_output_size=BLOCK_SIZE)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"the memory stream is corrupt: a page's delta does not unpack against its block "
                             f"({exc})") from None
    if len(page) != BLOCK_SIZE:
        raise IntegrityError(f"the memory stream is corrupt: a page's delta makes {len(page)} bytes, not a page")
    return page


__all__ = ["FEATURE", "MAX_DELTA", "Similar", "delta", "undelta"]
