"""The :class:`HashCache` facade: opening and closing a cache, statistics; the table, the file
registry, lookups and priming are its parts (one object, one lock)."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import random
import sqlite3
import threading
import time
from collections import OrderedDict
from typing import Any

from hashcache.cache.format import (
    _FLUSH_OPS,
    _FLUSH_SECONDS,
    _MASK64,
    _STAT_NAMES,
    _STATS,
    DEFAULT_READAHEAD,
    DEFAULT_READAHEAD_CAPACITY,
    DEFAULT_SIZE,
    ENTRIES_PER_BUCKET,
    PAGE_SIZE,
    STATS_OFFSET,
    CacheError,
    _create_file,
    _paths_db,
    _read_header,
    narrow_mode,
)
from hashcache.cache.lookup import VerifiedLookup
from hashcache.cache.priming import Priming
from hashcache.cache.registry import FileRegistry, _open_paths_db
from hashcache.cache.table import BucketTable

# One process-wide lock for the statistics page: POSIX record locks do not exclude threads of one
# process, and closing any descriptor of a file drops all of the process's locks on it.
_STATS_LOCK = threading.Lock()


class HashCache(FileRegistry, BucketTable, VerifiedLookup, Priming):
    """An open hash cache. Create or open one with :meth:`HashCache.open`; close it (or use ``with``)."""

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        size_bytes: int | None = None,
        create: bool = True,
        *,
        readahead: int = DEFAULT_READAHEAD,
        readahead_capacity: int = DEFAULT_READAHEAD_CAPACITY,
        evict_sample: int | None = None,
    ) -> HashCache:
        """Open the cache at ``path``, creating it (``size_bytes``, default 64 MiB) if missing and ``create``.

        ``size_bytes`` only matters when the file is created (it is rounded down to whole pages);
        an existing cache keeps its size. ``readahead`` is the largest number of blocks read after
        a verified hit (0 disables read-ahead), ``readahead_capacity`` the number of primed blocks kept
        in memory, ``evict_sample`` overrides the number of slots sampled per eviction (default:
        the value recorded at creation, 16). Raises CacheError if the file is not a usable cache.
        """
        path = os.path.abspath(os.fspath(path))
        if readahead < 0 or readahead_capacity < 0:
            raise ValueError("readahead and readahead_capacity must be >= 0")
        if evict_sample is not None and not 1 <= evict_sample <= ENTRIES_PER_BUCKET:
            raise ValueError(f"evict_sample must be between 1 and {ENTRIES_PER_BUCKET}")
        fd = -1
        for _ in range(5):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                narrow_mode(path)
                break
            except FileNotFoundError:
                if not create:
                    raise CacheError(f"hash cache {path}: does not exist") from None
                _create_file(path, DEFAULT_SIZE if size_bytes is None else size_bytes, evict_sample)
            except OSError as e:
                raise CacheError(f"hash cache {path}: cannot open: {e.strerror or e}") from e
        else:  # pragma: no cover - created and deleted again under us five times
            raise CacheError(f"hash cache {path}: keeps disappearing while being opened")
        mm: mmap.mmap | None = None
        try:
            header = _read_header(fd, path)
            mm = mmap.mmap(fd, header["file_size"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with contextlib.suppress(AttributeError, OSError):
                mm.madvise(mmap.MADV_RANDOM)  # one random page per lookup: kernel read-ahead only hurts
            db = _open_paths_db(_paths_db(path), header["uuid"])
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            raise
        return cls(
            path=path,
            fd=fd,
            mm=mm,
            header=header,
            db=db,
            readahead=readahead,
            readahead_capacity=readahead_capacity,
            evict_sample=header["evict_sample"] if evict_sample is None else evict_sample,
        )

    def __init__(
        self,
        *,
        path: str,
        fd: int,
        mm: mmap.mmap,
        header: dict[str, Any],
        db: sqlite3.Connection,
        readahead: int,
        readahead_capacity: int,
        evict_sample: int,
    ) -> None:
        """Private: use :meth:`HashCache.open`."""
        self.path = path
        self.paths_path = _paths_db(path)
        self.size_bytes: int = header["file_size"]
        self.bucket_count: int = header["bucket_count"]
        self.capacity = self.bucket_count * ENTRIES_PER_BUCKET
        self.created_ns: int = header["created_ns"]
        self.uuid: str = header["uuid"]
        self.readahead = readahead
        self.readahead_capacity = max(readahead_capacity, readahead + 1) if readahead else readahead_capacity
        self.evict_sample = evict_sample
        #: Data reads (preads of cached blocks) this object made: one per verified lookup from disk.
        self.disk_reads = 0
        self._fd = fd
        self._mm = mm
        self._q = memoryview(mm).cast("Q")  # for reading a bucket's keys as one strided copy
        self._db = db
        self._lock = threading.RLock()
        self._rng = random.Random(os.urandom(16))
        self._files: dict[int, tuple[str, int, int]] = {}  # id -> (path, dev, ino), from the path table
        self._path_ids: dict[str, tuple[int, int, int]] = {}  # path -> (id, dev, ino)
        self._dead: set[int] = set()  # ids whose file is gone, replaced or unknown
        self._fds: OrderedDict[int, int] = OrderedDict()  # id -> open descriptor (LRU)
        self._primed: OrderedDict[bytes, tuple[bytes, int, int]] = OrderedDict()  # hash -> (data, id, offset)
        self._primed_prefix: dict[bytes, bytes] = {}  # hash prefix -> hash, for lookup_prefix
        self._windows: dict[int, list[int]] = {}  # id -> [next read-ahead window, used since the last read]
        self._delta = [0] * len(_STAT_NAMES)
        self._ops = 0
        self._last_flush = time.monotonic()
        self._closed = False

    def __enter__(self) -> HashCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.capacity} entries"
        return f"<HashCache {self.path} {state}>"

    def close(self) -> None:
        """Merge statistics into the file and release everything. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self._flush_stats()
            finally:
                self._closed = True
                for fd in self._fds.values():
                    with contextlib.suppress(OSError):
                        os.close(fd)
                self._fds.clear()
                self._primed.clear()
                self._primed_prefix.clear()
                self._q.release()
                self._mm.close()
                os.close(self._fd)
                self._db.close()

    def sync(self) -> None:
        """Merge statistics and write the table back to disk (msync). Never needed for correctness."""
        with self._lock:
            self._check_open()
            self._flush_stats()
            self._mm.flush()

    def clear_readahead(self) -> None:
        """Forget primed blocks and close cached descriptors (the table is untouched)."""
        with self._lock:
            self._primed.clear()
            self._primed_prefix.clear()
            self._windows.clear()
            for fd in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()

    def _count(self, which: int, n: int = 1) -> None:
        self._delta[which] += n
        self._ops += n

    def _maybe_flush(self) -> None:
        if self._ops >= _FLUSH_OPS or (self._ops and time.monotonic() - self._last_flush > _FLUSH_SECONDS):
            self._flush_stats()

    def _flush_stats(self) -> None:
        self._last_flush = time.monotonic()
        if not self._ops:
            return
        delta = self._delta
        with _STATS_LOCK:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, PAGE_SIZE, STATS_OFFSET)
            try:
                old = _STATS.unpack_from(self._mm, STATS_OFFSET)
                _STATS.pack_into(self._mm, STATS_OFFSET, *((a + b) & _MASK64 for a, b in zip(old, delta, strict=True)))
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, PAGE_SIZE, STATS_OFFSET)
        self._delta = [0] * len(_STAT_NAMES)
        self._ops = 0

    def stats(self) -> dict[str, Any]:
        """Persistent counters (all processes, since creation) plus the table's geometry and fill."""
        with self._lock:
            self._check_open()
            self._flush_stats()
            with _STATS_LOCK:
                fcntl.lockf(self._fd, fcntl.LOCK_SH, PAGE_SIZE, STATS_OFFSET)
                try:
                    counters = dict(zip(_STAT_NAMES, _STATS.unpack_from(self._mm, STATS_OFFSET), strict=True))
                finally:
                    fcntl.lockf(self._fd, fcntl.LOCK_UN, PAGE_SIZE, STATS_OFFSET)
            try:
                files = self._db.execute("SELECT COUNT(*) FROM files").fetchone()[0]
            except sqlite3.Error:
                files = None
            return {
                "path": self.path,
                "size_bytes": self.size_bytes,
                "capacity": self.capacity,
                "buckets": self.bucket_count,
                "entries_per_bucket": ENTRIES_PER_BUCKET,
                "used": self.used_entries(),
                **counters,
                "files": files,
                "created_ns": self.created_ns,
                "evict_sample": self.evict_sample,
                "readahead": self.readahead,
                "primed_blocks": len(self._primed),
            }

    def _check_open(self) -> None:
        if self._closed:
            raise CacheError(f"hash cache {self.path}: already closed")
