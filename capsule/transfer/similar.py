"""The sender's side of HCP deltas: which blocks a receiver lacks travel as deltas (``hashcache/delta.py``).

A pushed layer whose parent the receiver holds sends each block it lacks as a delta against blocks of
the parent chain where that pays, and whole otherwise. References, in order of preference:

1. the same file in the parent version: the parent's blocks at the same offset of the file at the same
   guest path (± a block), found in the guests' ext4 file systems (``extmap.py``);
2. the parent chain's block at the same disk offset (an inode table, a bitmap: metadata rewritten in
   place), for blocks of no file or of a file new in this version.

A delta is kept when its bytes are at most ``PAYS`` of the block's own zstd -19 frame (the whole block
also travels compressed, often in a stream that does better than a frame of its own). A source whose
first ``TRIAL`` deltas mostly did not pay (random data written over old data) is tried no more for the
object, so a layer of novel data costs a few milliseconds of trials, not a delta per block."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

from capsule.store import Store
from capsule.store.objectio import BlockReader
from capsule.transfer import extmap
from hashcache import delta, native
from hashcache.blocks import BLOCK_SIZE
from hashcache.delta import Delta

PAYS = 0.6          # a delta's bytes / the block's own zstd -19 frame, at most
TRIAL = 64          # deltas of one source tried before its rate of paying ones decides
MIN_PAYING = 0.1    # ... below this share, that source is tried no more for this object
_ZERO = bytes(BLOCK_SIZE)


class ParentChain:
    """Blocks of the disk a layer shows (the layer and its ancestors), read from this store."""

    def __init__(self, store: Store, top: str) -> None:
        self.readers: list[BlockReader] = []
        lid: str | None = top
        while lid is not None:
            self.readers.append(BlockReader(store, "layer", lid))
            row = store.catalogue.layer(lid)
            lid = row.parent if row is not None else None

    def read(self, index: int) -> bytes | None:
        """The block at ``index``; None for a zero or unallocated one (never a reference)."""
        for reader in self.readers:
            own = reader.own(index)
            if own is None:
                continue
            if not own:
                return None
            data = reader.read([index])[0]
            return None if data == _ZERO else data
        return None

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


@dataclass
class _Source:
    tried: int = 0
    paid: int = 0

    @property
    def open(self) -> bool:
        return self.tried < TRIAL or self.paid >= MIN_PAYING * self.tried


class Similar:
    """Deltas for one layer's blocks against its parent chain (``with Similar(...) as s: s.split(...)``)."""

    def __init__(self, store: Store, layer_id: str, parent_id: str) -> None:
        self.store, self.layer_id, self.parent_id = store, layer_id, parent_id
        self._stack = ExitStack()
        self._chain: ParentChain | None = None
        self._views: tuple[extmap.Ext4, extmap.Ext4] | None = None
        self._sources = {"file": _Source(), "offset": _Source()}
        self.delta_blocks = 0
        self.delta_bytes = 0

    def __enter__(self) -> Similar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        if self._chain is not None:
            self._chain.close()

    def _open(self) -> ParentChain:
        if self._chain is None:
            self._chain = ParentChain(self.store, self.parent_id)
            self._views = self._stack.enter_context(extmap.layer_views(self.store, self.layer_id, self.parent_id))
        return self._chain

    def _candidates(self, needed: list[int]) -> dict[int, tuple[str, list[int]]]:
        """index → (source, parent block indices to take as references, most similar last)."""
        out: dict[int, tuple[str, list[int]]] = {}
        if self._views is not None and self._sources["file"].open:
            child, parent = self._views
            out = {i: ("file", refs) for i, refs in extmap.references(child, parent, needed).items()}
        if self._sources["offset"].open:
            for i in needed:
                out.setdefault(i, ("offset", [i]))
        return out

    def split(self, needed: list[int], reader: BlockReader) -> tuple[list[int], list[tuple[int, Delta]]]:
        """``needed`` (ascending) as (indices to send whole, (index, delta) to send as deltas)."""
        if not needed:
            return needed, []
        chain = self._open()
        whole: list[int] = []
        deltas: list[tuple[int, Delta]] = []
        candidates = self._candidates(needed)
        for index in needed:
            found = candidates.get(index)
            if found is None or not self._sources[found[0]].open:
                whole.append(index)
                continue
            source = self._sources[found[0]]
            refs = [b for b in (chain.read(j) for j in found[1][-delta.MAX_REFS:]) if b is not None]
            if not refs:
                whole.append(index)
                continue
            block = reader.read([index])[0]
            d = delta.encode(block, refs)
            source.tried += 1
            if d.wire_size <= PAYS * len(native.compress(block, 19)):
                source.paid += 1
                deltas.append((index, d))
                self.delta_blocks += 1
                self.delta_bytes += d.wire_size
            else:
                whole.append(index)
        return whole, deltas
