"""Looking up: every hit read from its file and verified against the full hash; adaptive
read-ahead keeps the blocks after a hit in memory, keyed by their own hash."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence

from blake3 import blake3

from hashcache import native
from hashcache.blocks import BLOCK_SIZE, HASH_SIZE, ZERO_BLOCK, scan_blocks
from hashcache.cache.format import (
    _HITS,
    _MISSES,
    _RA_HITS,
    _UNAVAILABLE,
    _ZERO_HASH,
    BUCKETS_OFFSET,
    KEY_SIZE,
    READAHEAD_INITIAL,
    _check_hash,
)
from hashcache.cache.state import CacheState

_CANDIDATE = struct.Struct("<qQQ")  # native.cache_candidates: position (-1: none), offset, file id


class VerifiedLookup(CacheState):
    """Part of :class:`HashCache`: lookups and read-ahead."""

    def lookup(self, hash32: bytes) -> bytes | None:
        """The 4 KiB block whose BLAKE3 hash is ``hash32``, read from a local file and verified; else None.

        A block at the end of a file shorter than 4 KiB comes back zero-padded (that is what its
        hash covers).
        """
        h = _check_hash(hash32)
        with self._lock:
            self._check_open()
            data = self._lookup(h, set())
            self._maybe_flush()
            return data

    def lookup_many(self, hashes: Iterable[bytes]) -> list[bytes | None]:
        """:meth:`lookup` for a batch; results in input order.

        Blocks in memory are served first; the rest are read in (file, offset) order, so blocks
        that are neighbours on disk come from one read-ahead, and each file is checked once.
        """
        hs = [_check_hash(h) for h in hashes]
        out: list[bytes | None] = [None] * len(hs)
        with self._lock:
            self._check_open()
            validated: set[int] = set()
            pending: list[tuple[int, int, int]] = []
            primed = self._primed
            for i, h in enumerate(hs):
                if h == _ZERO_HASH or h in primed:
                    out[i] = self._lookup(h, validated)
                    continue
                found = self._candidates(h)
                if not found:
                    self._count(_MISSES)
                    continue
                pending.append((found[0][2], found[0][3], i))
            pending.sort()
            for _, _, i in pending:
                out[i] = self._lookup(hs[i], validated)
            self._maybe_flush()
        return out

    def lookup_prefix(self, prefix: bytes) -> tuple[bytes, bytes] | None:
        """A verified block whose BLAKE3 hash starts with ``prefix`` (8 bytes, the table's key), as
        ``(data, full hash)``; else None. For transfers that send hash prefixes and verify the whole
        object against its digest afterwards."""
        if not isinstance(prefix, bytes) or len(prefix) != KEY_SIZE:
            raise ValueError(f"a hash prefix is {KEY_SIZE} bytes")
        with self._lock:
            self._check_open()
            full = self._primed_prefix.get(prefix)
            if full is not None and full in self._primed:
                data = self._lookup(full, set())
                if data is not None:
                    return data, full
            validated: set[int] = set()
            for pos, head, fid, off in self._candidates(prefix + bytes(HASH_SIZE - KEY_SIZE)):
                data = self._read_verified(prefix, fid, off, validated)
                if data:
                    self._bump_uses(pos)
                    self._count(_HITS)
                    self._maybe_flush()
                    return data, blake3(data).digest()
                if data is None:
                    self._invalidate(pos, head)
            self._count(_MISSES)
            self._maybe_flush()
            return None

    def lookup_prefix_many(self, prefixes: Sequence[bytes]) -> list[tuple[bytes, bytes] | None]:
        """:meth:`lookup_prefix` for a batch, results in input order: the bucket search and the reads
        and hashes of the hits run in the compiled extension (all cores, one pass per file); anything
        unusual — a primed block, a file that must be re-validated, a block that does not verify —
        goes through :meth:`lookup_prefix` itself, the reference. No read-ahead (the batch says what
        is wanted), so a block whose own table entry is gone is not found through a neighbour's hit,
        as the per-block path's read-ahead may find it; with read-ahead off the two agree exactly
        (tests/unit/test_native_cache.py)."""
        for p in prefixes:
            if not isinstance(p, bytes) or len(p) != KEY_SIZE:
                raise ValueError(f"a hash prefix is {KEY_SIZE} bytes")
        out: list[tuple[bytes, bytes] | None] = [None] * len(prefixes)
        slow: list[int] = []
        with self._lock:
            self._check_open()
            primed = self._primed_prefix
            found = native.cache_candidates(self._mm, self.bucket_count, BUCKETS_OFFSET, b"".join(prefixes))
            by_file: dict[int, list[tuple[int, int, int]]] = {}
            for i, (pos, off, fid) in enumerate(_CANDIDATE.iter_unpack(found)):
                if prefixes[i] in primed:
                    slow.append(i)
                elif pos < 0:
                    self._count(_MISSES)
                else:
                    by_file.setdefault(fid, []).append((off, i, pos))
            validated: set[int] = set()
            for fid, hits in by_file.items():
                fd = self._fd_for(fid, validated)
                if fd is None:
                    slow.extend(i for _off, i, _pos in hits)
                    continue
                hits.sort()
                got = native.read_verified(fd, [off for off, _i, _pos in hits],
                                           b"".join(prefixes[i] for _off, i, _pos in hits))
                self.disk_reads += len(hits)
                used: list[int] = []
                for (_off, i, pos), hit in zip(hits, got, strict=True):
                    if hit is not None:
                        out[i] = hit
                        used.append(pos)
                    else:
                        slow.append(i)
                native.cache_bump_uses(self._mm, used)  # _bump_uses for each, in the extension
                self._count(_HITS, len(used))
            self._maybe_flush()
        for i in sorted(slow):
            out[i] = self.lookup_prefix(prefixes[i])
        return out

    def _lookup(self, h: bytes, validated: set[int]) -> bytes | None:
        if h == _ZERO_HASH:
            self._count(_HITS)
            return ZERO_BLOCK
        primed = self._primed.get(h)
        if primed is not None:
            self._primed.move_to_end(h)
            state = self._windows.get(primed[1])
            if state is not None:  # the window of this file is being used: widen the next one
                state[0] = min(self.readahead, state[0] * 2)
                state[1] = 1
            found = self._candidates(h)
            if found:
                self._bump_uses(found[0][0])
            elif primed[1] not in self._dead:
                self._put(h, primed[1], primed[2])  # evicted from the table but still useful: back in
            self._count(_HITS)
            self._count(_RA_HITS)
            return primed[0]
        for pos, head, fid, off in self._candidates(h):
            data = self._read_verified(h, fid, off, validated)
            if data:
                self._bump_uses(pos)
                self._count(_HITS)
                return data
            if data is None:
                self._invalidate(pos, head)
        self._count(_MISSES)
        return None

    def _read_verified(self, h: bytes, fid: int, off: int, validated: set[int]) -> bytes | None:
        """The block at ``(fid, off)`` if it hashes to ``h``; None if the entry is wrong (file gone,
        replaced, too short, data different); ``_UNAVAILABLE`` if the file cannot be read right now."""
        fd = self._fd_for(fid, validated)
        if fd is None:
            return None if fid in self._dead else _UNAVAILABLE
        try:
            buf = os.pread(fd, BLOCK_SIZE * (1 + self._window(fid)), off)
        except OSError:
            return _UNAVAILABLE  # EIO and the like: a miss, but the entry may be fine tomorrow
        self.disk_reads += 1
        n = len(buf)
        if n >= BLOCK_SIZE:
            block = buf[:BLOCK_SIZE] if n > BLOCK_SIZE else buf
        elif n:
            block = buf + ZERO_BLOCK[n:]  # the file's short last block, hashed zero-padded
        else:
            return None  # beyond the end of the file
        if blake3(block).digest()[: len(h)] != h:  # h may be a prefix (lookup_prefix)
            return None
        if n > BLOCK_SIZE:
            self._prime(buf, fid, off)
        return block

    def _window(self, fid: int) -> int:
        """Blocks to read ahead of this hit in file ``fid`` (adaptive: see the module docstring)."""
        ra = self.readahead
        if not ra:
            return 0
        windows = self._windows
        state = windows.get(fid)
        if state is None or not state[1]:
            if len(windows) >= 4096:
                windows.clear()
            state = windows[fid] = [min(ra, READAHEAD_INITIAL), 0]
        state[1] = 0
        return state[0]

    def _prime(self, buf: bytes, fid: int, off: int) -> None:
        """Keep the blocks after a hit in memory, keyed by their own hash."""
        primed = self._primed
        cap = self.readahead_capacity
        if not cap:
            return
        rest = memoryview(buf)[BLOCK_SIZE:]
        for i, h in enumerate(scan_blocks(rest)):
            if h is None:
                continue
            a = i * BLOCK_SIZE
            data = buf[BLOCK_SIZE + a : 2 * BLOCK_SIZE + a]
            if len(data) < BLOCK_SIZE:
                data += ZERO_BLOCK[len(data) :]
            primed[h] = (data, fid, off + BLOCK_SIZE + a)
            primed.move_to_end(h)
            self._primed_prefix[h[:KEY_SIZE]] = h
        while len(primed) > cap:
            primed.popitem(last=False)
        if len(self._primed_prefix) > 2 * cap:
            self._primed_prefix = {h[:KEY_SIZE]: h for h in primed}
