"""A shadow: a sparse file of 4 KiB blocks plus a persistent presence bitmap.

Used for objects that arrive block by block: HCP receives (so a killed
transfer resumes where it stopped) and the disk server's local copies of
remote layers (§4.3). The rule that makes it crash-safe: block data is
written and made durable (fdatasync) *before* its presence bit is set, so a
block marked present is always complete. Callers only store verified blocks.
A lost bit costs a refetch, never wrong data."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from hashcache import native
from hashcache.atomic import pwrite_all
from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import HashcacheError

_MAGIC = b"CAPSULE-SHADOW1\n"
_HDR = 64


class ShadowError(HashcacheError):
    """A shadow file (or its presence bitmap) cannot be opened, read or written."""

    code = "shadow_error"


class Shadow:
    """``<base>.data`` (sparse, ``nblocks`` × 4 KiB) and ``<base>.bitmap``."""

    def __init__(self, base: Path, nblocks: int) -> None:
        if nblocks < 0:
            raise ValueError("nblocks must be >= 0")
        self.base = base
        self.nblocks = nblocks
        self.data_path = base.with_name(base.name + ".data")
        self.bitmap_path = base.with_name(base.name + ".bitmap")
        self._lock = threading.Lock()
        base.parent.mkdir(parents=True, exist_ok=True)
        self._data_fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT, 0o644)
        size = nblocks * BLOCK_SIZE
        if os.fstat(self._data_fd).st_size < size:
            os.ftruncate(self._data_fd, size)
        map_len = _HDR + (nblocks + 7) // 8
        fd = os.open(self.bitmap_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                os.ftruncate(fd, map_len)
                os.pwrite(fd, _MAGIC + nblocks.to_bytes(8, "little"), 0)
            elif st.st_size != map_len:
                raise ShadowError(f"shadow bitmap {self.bitmap_path} does not match {nblocks} blocks; delete it")
            self._map = mmap.mmap(fd, map_len)
        finally:
            os.close(fd)
        if self._map[: len(_MAGIC)] != _MAGIC or int.from_bytes(self._map[16:24], "little") != nblocks:
            self._map.close()
            raise ShadowError(f"shadow bitmap {self.bitmap_path} is foreign or corrupt; delete it to start over")

    def close(self) -> None:
        with self._lock:
            if self._map.closed:
                return
            self._map.flush()
            self._map.close()
            os.close(self._data_fd)

    def __enter__(self) -> Shadow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def has(self, index: int) -> bool:
        return bool(self._map[_HDR + (index >> 3)] & (1 << (index & 7)))

    def missing(self, indices: Iterable[int]) -> list[int]:
        m = self._map
        return [i for i in indices if not m[_HDR + (i >> 3)] & (1 << (i & 7))]

    def present_count(self) -> int:
        return sum(bin(b).count("1") for b in self._map[_HDR:])

    def read(self, index: int) -> bytes:
        if not 0 <= index < self.nblocks:
            raise IndexError(index)
        return os.pread(self._data_fd, BLOCK_SIZE, index * BLOCK_SIZE).ljust(BLOCK_SIZE, b"\0")

    def hash_blocks(self, indices: Sequence[int]) -> bytes:
        """BLAKE3 of each block at ``indices`` (32 bytes each, concatenated), read and hashed by the
        extension on every core; reference: ``hash_block(self.read(i))``."""
        for i in indices:
            if not 0 <= i < self.nblocks:
                raise IndexError(i)
        return native.hash_at(self._data_fd, list(indices))

    def read_run(self, start: int, count: int) -> bytes:
        return os.pread(self._data_fd, count * BLOCK_SIZE, start * BLOCK_SIZE).ljust(count * BLOCK_SIZE, b"\0")

    def store(self, blocks: Sequence[tuple[int, bytes]], durable: bool = True) -> None:
        """Write verified blocks, make them durable, then mark them present."""
        if not blocks:
            return
        self.write(blocks, durable=durable)
        self.mark_present(index for index, _d in blocks)

    def write(self, blocks: Sequence[tuple[int, bytes]], durable: bool = False) -> None:
        """Write verified blocks without marking them present: many writes, then one :meth:`sync`, then
        :meth:`mark_present` keeps the rule at the cost of one fdatasync instead of one per write."""
        if not blocks:
            return
        for index, data in blocks:
            if not 0 <= index < self.nblocks or len(data) != BLOCK_SIZE:
                raise ValueError(f"bad block {index} ({len(data)} bytes)")
        # one pwrite per run of adjacent blocks (then fdatasync if durable): in the extension, GIL released
        native.pwrite_runs(self._data_fd, [i for i, _d in blocks], b"".join(d for _i, d in blocks), durable)

    def sync(self) -> None:
        """Make every block written so far durable (before marking them present)."""
        os.fdatasync(self._data_fd)

    def _reference_write(self, blocks: Sequence[tuple[int, bytes]], durable: bool) -> None:
        """Reference (pure Python) of the write in :meth:`store`."""
        ordered = sorted(blocks, key=lambda b: b[0])
        pos = 0
        while pos < len(ordered):
            end = pos + 1
            while end < len(ordered) and ordered[end][0] == ordered[pos][0] + (end - pos):
                end += 1
            pwrite_all(self._data_fd, b"".join(d for _i, d in ordered[pos:end]), ordered[pos][0] * BLOCK_SIZE)
            pos = end
        if durable:
            os.fdatasync(self._data_fd)

    def mark_present(self, indices: Iterable[int]) -> None:
        """Mark blocks present that need no data (all-zero blocks are holes)."""
        with self._lock:
            m = self._map
            for index in indices:
                m[_HDR + (index >> 3)] |= 1 << (index & 7)

    def forget(self, indices: Iterable[int]) -> None:
        """Clear presence bits (blocks found to be wrong): they will be fetched again."""
        with self._lock:
            m = self._map
            for index in indices:
                m[_HDR + (index >> 3)] &= ~(1 << (index & 7)) & 0xFF

    def flush(self) -> None:
        self._map.flush()

    def remove(self) -> None:
        self.close()
        self.data_path.unlink(missing_ok=True)
        self.bitmap_path.unlink(missing_ok=True)
