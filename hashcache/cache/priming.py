"""Priming: indexing whole files at once, from their manifests (a layer or memory image just
sealed or received) or by reading and hashing them (existing files and directories)."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from hashcache.blocks import BLOCK_SIZE, scan_blocks
from hashcache.cache.format import (
    _ZERO_HASH,
    PRIME_CHUNK,
    Progress,
    _check_hash,
)
from hashcache.cache.state import CacheState
from hashcache.errors import HashcacheError
from hashcache.manifest import KIND_LAYER, Manifest, _data_extents
from hashcache.qcow2 import DATA, Qcow2Image


@dataclass
class PrimeResult:
    """What :meth:`HashCache.prime_paths` did."""

    files: int = 0  # files read and indexed
    skipped: int = 0  # files unchanged since they were last indexed
    blocks: int = 0  # non-zero blocks inserted
    bytes_read: int = 0
    errors: list[str] = field(default_factory=list)  # "path: reason" for files that could not be read


def _read_upto(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; fewer bytes only at the end of the file. Returns the count."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class Priming(CacheState):
    """Part of :class:`HashCache`: inserting whole files."""

    def insert_file(
        self,
        path: str | os.PathLike[str],
        hashes: Manifest | Iterable[bytes | None] | Iterable[tuple[int, bytes]] | Iterable[tuple[int, bool, bytes]],
    ) -> int:
        """Insert every block of one file at once (a layer or memory image just sealed or received).

        ``hashes`` is one of:

        * a :class:`~hashcache.manifest.Manifest`: a ``file`` manifest's block ``i`` lies at offset
          ``i * 4096``; a ``layer`` manifest describes guest blocks of the qcow2 file at ``path``,
          whose host offsets are read from the image (zero and unallocated blocks are skipped);
        * per-block hashes in order (``bytes``, or None for a block to skip, e.g. a zero block);
        * ``(block_index, hash)`` pairs or ``(block_index, is_zero, hash)`` records.

        The data is not read (every hit is verified later). Returns the number of entries written.
        """
        with self._lock:
            self._check_open()
            fid = self.file_id(path)
            written = self._put_many((_check_hash(h), fid, off)
                                     for h, off in self._block_offsets(os.fspath(path), hashes) if h != _ZERO_HASH)
            self._maybe_flush()
        return written

    def _block_offsets(self, path: str, hashes: object) -> Iterator[tuple[bytes, int]]:
        if isinstance(hashes, Manifest):
            if hashes.block_size != BLOCK_SIZE:
                raise ValueError(f"manifest block size {hashes.block_size} is not {BLOCK_SIZE}")
            if hashes.kind == KIND_LAYER:
                by_index = {i: h for i, zero, h in hashes.records() if not zero}
                with Qcow2Image(path) as img:
                    for run in img.iter_block_runs():
                        if run.kind is DATA and run.host_offset is not None:
                            for i in range(run.count):
                                h = by_index.get(run.start + i)
                                if h is not None:
                                    yield h, run.host_offset + i * BLOCK_SIZE
            else:
                for i, zero, h in hashes.records():
                    if not zero:
                        yield h, i * BLOCK_SIZE
            return
        if not isinstance(hashes, Iterable) or isinstance(hashes, bytes | bytearray | str):
            raise TypeError("hashes must be a Manifest, per-block hashes or (index, hash) records")
        for i, item in enumerate(hashes):
            if item is None:
                continue
            if isinstance(item, bytes | bytearray | memoryview):
                yield bytes(item), i * BLOCK_SIZE
            elif isinstance(item, tuple) and len(item) == 2:
                yield item[1], item[0] * BLOCK_SIZE
            elif isinstance(item, tuple) and len(item) == 3:
                if not item[1]:
                    yield item[2], item[0] * BLOCK_SIZE
            else:
                raise TypeError(f"cannot use {item!r:.80} as a block hash or (index, hash) record")

    def prime_paths(
        self,
        paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str],
        progress: Progress | None = None,
        *,
        force: bool = False,
    ) -> PrimeResult:
        """Index existing files (directories recursively): hash every non-zero 4 KiB block and insert it.

        Every file is treated as raw bytes (a qcow2 file's data clusters are 4 KiB aligned, so its
        guest blocks are found too); holes and all-zero blocks are skipped. A file indexed before
        and unchanged since (same inode, size and mtime) is skipped unless ``force``. Unreadable
        files are reported in ``errors`` and skipped. ``progress(done_bytes, total_bytes)`` is called
        after every chunk.
        """
        if isinstance(paths, str | os.PathLike):
            paths = [paths]
        result = PrimeResult()
        with self._lock:
            self._check_open()
            files = self._walk(paths, result)
            total = sum(st.st_size for _, st in files)
            done = 0
            buf = bytearray(PRIME_CHUNK)
            for real, st in files:
                try:
                    self._prime_file(real, buf, result, force, progress, done, total)
                except (OSError, HashcacheError, sqlite3.Error) as e:
                    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                    result.errors.append(f"{real}: {reason}")
                done += st.st_size
                if progress is not None:
                    progress(done, total)
            self._flush_stats()
        return result

    def _walk(self, paths: Iterable[str | os.PathLike[str]], result: PrimeResult) -> list[tuple[str, os.stat_result]]:
        own = {self.path, self.paths_path, self.paths_path + "-wal", self.paths_path + "-shm"}
        seen: set[tuple[int, int]] = set()
        out: list[tuple[str, os.stat_result]] = []

        def consider(p: str) -> None:
            real = os.path.realpath(p)
            if real in own:
                return
            try:
                st = os.stat(real)
            except OSError as e:
                result.errors.append(f"{p}: {e.strerror or e}")
                return
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or (st.st_dev, st.st_ino) in seen:
                return
            seen.add((st.st_dev, st.st_ino))
            out.append((real, st))

        def on_error(e: OSError) -> None:
            result.errors.append(f"{e.filename}: {e.strerror or e}")

        for top in paths:
            top = os.path.abspath(os.fspath(top))
            if os.path.isdir(top):
                for d, dirs, names in os.walk(top, onerror=on_error):
                    dirs.sort()
                    for name in sorted(names):
                        consider(os.path.join(d, name))
            else:
                consider(top)
        return out

    def _prime_file(
        self,
        real: str,
        buf: bytearray,
        result: PrimeResult,
        force: bool,
        progress: Progress | None,
        done: int,
        total: int,
    ) -> None:
        fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return
            fid = self._register(real, st)
            if not force:
                row = self._db.execute("SELECT primed_size, primed_mtime_ns FROM files WHERE id = ?", (fid,)).fetchone()
                if row is not None and row == (st.st_size, st.st_mtime_ns):
                    result.skipped += 1
                    return
            size = st.st_size
            whole = memoryview(buf)
            zero_hash = _ZERO_HASH
            for start, end in _data_extents(fd, size):
                for off in range(start, end, PRIME_CHUNK):
                    n = min(PRIME_CHUNK, end - off)
                    view = whole[:n]
                    got = _read_upto(fd, view, off)
                    result.bytes_read += got
                    result.blocks += self._put_many((h, fid, off + i * BLOCK_SIZE)
                                                    for i, h in enumerate(scan_blocks(view, got))
                                                    if h is not None and h != zero_hash)
                    if progress is not None:
                        progress(done + off + n, total)
                    if got < n:
                        break  # the file shrank: index what is there
            result.files += 1
            after = os.fstat(fd)
            if (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns):
                with self._tx():
                    self._db.execute(
                        "UPDATE files SET primed_size = ?, primed_mtime_ns = ? WHERE id = ?",
                        (st.st_size, st.st_mtime_ns, fid),
                    )
        finally:
            os.close(fd)
