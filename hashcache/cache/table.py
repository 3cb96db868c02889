"""The memory-mapped bucket table: hash -> (file id, offset) entries in page-sized buckets,
written without locks (key cleared, entry written, key published last), evicting the least
used of a random sample when a bucket is full."""

from __future__ import annotations

import os
import zlib
from array import array
from collections.abc import Iterable

from hashcache import native
from hashcache.cache.format import (
    _CHECKED,
    _ENTRY,
    _EVICTIONS,
    _HEAD,
    _INSERTS,
    _INVALIDATIONS,
    _MAX_USES,
    _TAIL,
    _U32,
    _UPDATES,
    _ZERO8,
    _ZERO_HASH,
    BUCKET_SIZE,
    BUCKETS_OFFSET,
    ENTRIES_PER_BUCKET,
    ENTRY_SIZE,
    KEY_SIZE,
    CacheEntry,
    _check_hash,
    _key,
)
from hashcache.cache.state import CacheState


def _find_zero_key(keys: bytes, start: int, end: int) -> int:
    """Byte position of the first all-zero key (8 bytes at a multiple of 8) within ``keys[start:end]``, or -1."""
    pos = keys.find(_ZERO8, start, end)
    while pos >= 0 and pos % KEY_SIZE:
        pos = keys.find(_ZERO8, pos + 1, end)
    return pos


class BucketTable(CacheState):
    """Part of :class:`HashCache`: the table itself, inserting and inspecting entries."""

    def _bucket(self, h: bytes) -> int:
        """Byte position of the bucket of hash ``h``: its first bits scaled to the bucket count."""
        return BUCKETS_OFFSET + ((int.from_bytes(h[:8], "big") * self.bucket_count) >> 64) * BUCKET_SIZE

    def _bucket_keys(self, start: int) -> bytes:
        """The 128 keys of the bucket at byte position ``start``, copied (8 bytes each, in slot order).

        Searching a copy, not the map: mmap.find of Python 3.11.0-3.11.3 may read past its end
        (CPython gh-105235) and crash; and a copy of the keys alone only matches at key boundaries
        or straddling two keys, which the alignment test rejects.
        """
        base = start >> 3
        return self._q[base : base + BUCKET_SIZE // 8 : ENTRY_SIZE // 8].tobytes()

    def _candidates(self, h: bytes) -> list[tuple[int, bytes, int, int]]:
        """Intact entries whose key matches ``h``: ``(position, checked bytes, file id, offset)``."""
        key = _key(h)
        start = self._bucket(h)
        keys = self._bucket_keys(start)
        out = []
        i = keys.find(key)
        while i >= 0:
            if not i % KEY_SIZE:
                pos = start + i * (ENTRY_SIZE // KEY_SIZE)
                raw = self._mm[pos : pos + 24]
                k, off, fid, check = _HEAD.unpack(raw)
                head = raw[:20]
                if k == key and fid and zlib.crc32(head) == check:
                    out.append((pos, head, fid, off))
            i = keys.find(key, i + 1)
        return out

    def _write_entry(self, pos: int, key: bytes, fid: int, off: int, uses: int) -> None:
        check = zlib.crc32(_CHECKED.pack(key, off, fid))
        mm = self._mm
        mm[pos : pos + KEY_SIZE] = _ZERO8  # the slot reads as empty while it is rewritten
        mm[pos + KEY_SIZE : pos + ENTRY_SIZE] = _TAIL.pack(off, fid, check, uses, 0)
        mm[pos : pos + KEY_SIZE] = key  # published last

    def _invalidate(self, pos: int, head: bytes) -> None:
        """Clear the entry at ``pos`` unless someone rewrote it since we read ``head``."""
        mm = self._mm
        if mm[pos : pos + 20] == head:
            mm[pos : pos + KEY_SIZE] = _ZERO8
        self._count(_INVALIDATIONS)

    def _bump_uses(self, pos: int) -> None:
        mm = self._mm
        (uses,) = _U32.unpack_from(mm, pos + 24)
        if uses < _MAX_USES:
            _U32.pack_into(mm, pos + 24, uses + 1)

    def _put(self, h: bytes, fid: int, off: int) -> bool:
        """Point ``h`` at ``(fid, off)``. True if an entry was written (False: it already was there)."""
        key = _key(h)
        start = self._bucket(h)
        mm = self._mm
        head = _CHECKED.pack(key, off, fid)
        keys = self._bucket_keys(start)
        i = keys.find(key)
        while i >= 0:
            if not i % KEY_SIZE:
                pos = start + i * (ENTRY_SIZE // KEY_SIZE)
                raw = mm[pos : pos + 28]
                if raw[:20] == head and _U32.unpack_from(raw, 20)[0] == zlib.crc32(head):
                    return False  # already there
                if raw[:KEY_SIZE] == key:
                    # Same key, another place (or a torn entry): re-point it, keep its use count if sound.
                    intact = _U32.unpack_from(raw, 20)[0] == zlib.crc32(raw[:20])
                    self._write_entry(pos, key, fid, off, _U32.unpack_from(raw, 24)[0] if intact else 0)
                    self._count(_UPDATES)
                    return True
            i = keys.find(key, i + 1)
        # An empty slot, searched from a random place so parallel writers pick different ones.
        rng = self._rng
        first = rng.getrandbits(7) * KEY_SIZE
        slot = _find_zero_key(keys, first, len(keys))
        if slot < 0:
            slot = _find_zero_key(keys, 0, first)
        if slot >= 0:
            self._write_entry(start + slot * (ENTRY_SIZE // KEY_SIZE), key, fid, off, 0)
            self._count(_INSERTS)
            return True
        # Full: evict the least used of a random sample.
        best_pos = -1
        best_uses = _MAX_USES + 1
        unpack = _U32.unpack_from
        if self.evict_sample >= ENTRIES_PER_BUCKET:
            sample: Iterable[int] = range(ENTRIES_PER_BUCKET)
        else:
            sample = [rng.getrandbits(7) for _ in range(self.evict_sample)]
        for i in sample:
            p = start + i * ENTRY_SIZE
            raw = mm[p : p + 28]
            (uses,) = unpack(raw, 24)
            if unpack(raw, 20)[0] != zlib.crc32(raw[:20]):
                best_pos = p  # a torn entry (crash, or garbage): worth nothing
                break
            if uses < best_uses:
                best_pos, best_uses = p, uses
        self._write_entry(best_pos, key, fid, off, 0)
        self._count(_INSERTS)
        self._count(_EVICTIONS)
        return True

    def _put_many(self, items: Iterable[tuple[bytes, int, int]]) -> int:
        """:meth:`_put` for many ``(hash, file id, offset)`` at once, in the compiled extension (same
        rules, same write order; its own random choices). Returns the number of entries written."""
        keys = bytearray()
        offsets: list[int] = []
        fids: list[int] = []
        for h, fid, off in items:
            keys += _key(h)
            fids.append(fid)
            offsets.append(off)
        if not offsets:
            return 0
        written, inserts, updates, evictions = native.cache_put_many(
            self._mm, self.bucket_count, BUCKETS_OFFSET, bytes(keys), offsets, fids, self.evict_sample,
            self._rng.getrandbits(64))
        for which, n in ((_INSERTS, inserts), (_UPDATES, updates), (_EVICTIONS, evictions)):
            self._count(which, n)
        return written

    def insert(self, hash32: bytes, file: str | os.PathLike[str] | int, offset: int) -> bool:
        """Record that the block with hash ``hash32`` lies in ``file`` (a path or a :meth:`file_id`) at ``offset``.

        Nothing is read or checked now; every later hit is verified. Returns True if an entry was
        written, False if this exact entry was already there (or the block is the zero block, which
        is never stored: :meth:`lookup` knows it).
        """
        h = _check_hash(hash32)
        with self._lock:
            self._check_open()
            fid = self._resolve(file, {})
            if not 0 <= offset < 1 << 63:
                raise ValueError(f"offset {offset} out of range")
            written = h != _ZERO_HASH and self._put(h, fid, offset)
            self._maybe_flush()
            return written

    def insert_many(self, items: Iterable[tuple[bytes, str | os.PathLike[str] | int, int]]) -> int:
        """Insert ``(hash32, file, offset)`` triples; returns the number of entries written."""
        written = 0
        with self._lock:
            self._check_open()
            ids: dict[object, int] = {}
            batch: list[tuple[bytes, int, int]] = []
            for h, file, offset in items:
                h = _check_hash(h)
                if not 0 <= offset < 1 << 63:
                    raise ValueError(f"offset {offset} out of range")
                if h != _ZERO_HASH:
                    batch.append((h, self._resolve(file, ids), offset))
            written = self._put_many(batch)
            self._maybe_flush()
        return written

    def _resolve(self, file: str | os.PathLike[str] | int, ids: dict[object, int]) -> int:
        if isinstance(file, int):
            if not 0 < file < 1 << 32:
                raise ValueError(f"file id {file} out of range")
            return file
        fid = ids.get(file)
        if fid is None:
            fid = ids[file] = self.file_id(file)
        return fid

    def peek(self, hash32: bytes) -> list[CacheEntry]:
        """The table entries whose key matches ``hash32`` (nothing read, verified or counted)."""
        h = _check_hash(hash32)
        with self._lock:
            self._check_open()
            key = _key(h)
            start = self._bucket(h)
            out = []
            for i in range(ENTRIES_PER_BUCKET):
                pos = start + i * ENTRY_SIZE
                k, off, fid, check, uses, _ = _ENTRY.unpack_from(self._mm, pos)
                if k == key:
                    info = self._file_info(fid)
                    intact = zlib.crc32(self._mm[pos : pos + 20]) == check
                    out.append(CacheEntry(pos, fid, info[0] if info else None, off, uses, intact))
            return out

    def used_entries(self) -> int:
        """Entries in use, counted by scanning every bucket's keys (~10 ms per 64 MiB of cache)."""
        with self._lock:
            self._check_open()
            q = self._q
            per_bucket = BUCKET_SIZE // 8
            step = ENTRY_SIZE // 8
            chunk = 512  # buckets per pass: bounded memory
            empty = 0
            base = BUCKETS_OFFSET // 8
            for b in range(0, self.bucket_count, chunk):
                nb = min(chunk, self.bucket_count - b)
                keys = array("Q", q[base + b * per_bucket : base + (b + nb) * per_bucket : step].tobytes())
                empty += keys.count(0)
            return self.capacity - empty
