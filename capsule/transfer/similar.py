"""The sender's side of HCP deltas: which blocks a receiver lacks travel as deltas (``hashcache/delta.py``).

A pushed layer whose parent the receiver holds sends the blocks it lacks as deltas against blocks of the
parent chain where that pays, and whole otherwise. References, in order of preference:

1. the same file in the parent version (the file at the same guest path, found in both versions' ext4
   file systems: ``extmap.py``): a changed file's new blocks as one delta against the old file's blocks
   (the window of at most 8 MiB around the same offsets). Measured against one delta per block (the old
   blocks at the same offset ± 1): a rebuilt library moves its code by more than a block, which only
   the whole old file finds (libsystemd-shared 252 → 254: 0.84 MB per file, 1.69 MB per block, 1.24 MB
   as xz; e2fsprogs' libext2fs 1.47.0 → 1.47.2: 0.030 MB, 0.038 MB, 0.174 MB);
2. the parent chain's block at the same disk offset (an inode table, a bitmap: metadata rewritten in
   place), a delta per block, for blocks of no file or of a file new in this version.

Deltas are made where they pay (``deltapick.py``: picked by the link like the codec; every block that
pays where the push was given a stream codec, ``--xz`` or ``--zstd-level`` from 10: bytes over speed).
B1 (a Debian guest's installed packages updated to their backports, over xz): 12.19 MB with deltas,
15.24 MB without (OSTree's static delta: 12.5 MB).

A delta is kept when its bytes are at most ``PAYS`` of its blocks' own zstd -9 frame (whole blocks also
travel compressed, often in a stream that does better). A source whose first ``TRIAL`` blocks mostly did
not pay (random data written over old data) is tried no more for the object, so a layer of novel data
costs a few milliseconds of trials, not a delta per block."""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass

from capsule.store import Store
from capsule.store.objectio import BlockReader, ChainReader
from capsule.transfer import extmap
from hashcache import delta, native
from hashcache.blocks import BLOCK_SIZE, hash_block
from hashcache.delta import Delta
from hashcache.hcp import MAX_BATCH

PAYS = 0.7          # a delta's bytes / its blocks' own zstd -9 frame, at most
TRIAL = 64          # blocks of one source tried before its rate of paying ones decides
MIN_PAYING = 0.1    # ... below this share, that source is tried no more for this object
_ZERO = bytes(BLOCK_SIZE)


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
        self._chain: ChainReader | None = None
        self._views: tuple[extmap.Ext4, extmap.Ext4] | None = None
        self._sources = {"file": _Source(), "offset": _Source()}
        self.delta_blocks = 0
        self.delta_bytes = 0
        self.timing = False          # rebuild and verify each delta made, as the receiver will, and time it
        self.decode_seconds = 0.0
        self.open_seconds = 0.0      # reading both versions' file systems, once (``extmap.layer_views``)
        self.level = delta.DELTA_LEVEL   # the zstd level of the deltas made

    def __enter__(self) -> Similar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    @property
    def opened(self) -> bool:
        """Whether both versions' file systems were read (the first :meth:`split` reads them)."""
        return self._chain is not None

    def _open(self) -> ChainReader:
        if self._chain is None:
            t0 = time.perf_counter()
            self._chain = self._stack.enter_context(ChainReader(self.store, self.parent_id))
            self._views = self._stack.enter_context(extmap.layer_views(self.store, self.layer_id, self.parent_id))
            self.open_seconds = time.perf_counter() - t0
        return self._chain

    def _matches(self, needed: list[int]) -> list[extmap.Match]:
        if self._views is None or not self._sources["file"].open:
            return []
        child, parent = self._views
        return extmap.matches(child, parent, needed)

    def _try(self, source: str, indices: list[int], blocks: list[bytes], refs: list[int],
             ref_blocks: list[bytes]) -> Delta | None:
        """One delta of ``indices``' blocks against the parent's ``refs``, if it pays (counted for ``source``)."""
        if not refs:
            return None
        d = delta.encode(indices, blocks, refs, ref_blocks, self.level)
        counts = self._sources[source]
        counts.tried += len(indices)
        if d.wire_size > PAYS * len(native.compress(b"".join(blocks), 9)):
            return None
        counts.paid += len(indices)
        self.delta_blocks += len(indices)
        self.delta_bytes += d.wire_size
        if self.timing:   # CPU seconds of this thread, as the search is measured
            t0 = time.thread_time()
            for block in delta.rebuild(d, ref_blocks):
                hash_block(block)
            self.decode_seconds += time.thread_time() - t0
        return d

    def _file_deltas(self, chain: ChainReader, match: extmap.Match, reader: BlockReader,
                     taken: set[int]) -> list[Delta]:
        """A changed file's new blocks as deltas against the old file's, ``MAX_BATCH`` blocks a delta."""
        out: list[Delta] = []
        mine = sorted(match.logical)
        for k in range(0, len(mine), MAX_BATCH):
            if not self._sources["file"].open:
                break
            part = mine[k:k + MAX_BATCH]
            offsets = [match.logical[i] for i in part]
            lo, hi = min(offsets), max(offsets) + 1
            spare = max(0, delta.MAX_REFS - (hi - lo)) // 2
            old = [j for j in match.parent_blocks(max(0, lo - spare), hi + spare)
                   if 0 <= j < chain.block_count][:delta.MAX_REFS]
            d = self._try("file", part, reader.read(part), old, [chain.read(j) or _ZERO for j in old])
            if d is not None:
                out.append(d)
                taken.update(part)
        return out

    def split(self, needed: list[int], reader: BlockReader) -> tuple[list[int], list[Delta]]:
        """``needed`` (ascending) as (indices to send whole, deltas of the others)."""
        if not needed:
            return needed, []
        chain = self._open()
        deltas: list[Delta] = []
        taken: set[int] = set()
        for match in self._matches(needed):
            deltas += self._file_deltas(chain, match, reader, taken)
        whole: list[int] = []
        for index in needed:
            if index in taken:
                continue
            if self._sources["offset"].open:
                ref = chain.read(index)
                if ref is not None and ref != _ZERO:
                    d = self._try("offset", [index], reader.read([index]), [index], [ref])
                    if d is not None:
                        deltas.append(d)
                        continue
            whole.append(index)
        return whole, deltas
