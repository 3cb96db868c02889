"""The persistent per-host hash cache: BLAKE3 hash of a 4 KiB block -> where a copy of it lies locally.

This is the hash cache of the Collective paper, section 4.4.1. HCP (hashed copy) looks up the hash of
every block it is about to transfer; a hit means the block is read from a local file instead of
being sent over the network.

Design
------

* **One fixed-size file per host**, memory-mapped by every process that uses it (agent, disk server,
  CLI). It is a hash table whose size is fixed at creation: a header page, a statistics page, then
  buckets of one 4 KiB page each. The first bits of a hash select its bucket
  (``(first 8 bytes, big-endian) * bucket_count >> 64``); a lookup searches that one page.
* **Entries hold no data**, only a pointer: the first 8 bytes of the hash, a file id, a byte
  offset, a use count and a check word. File ids are random 32-bit numbers resolved through a path
  table (SQLite in WAL mode, next to the cache file as ``<cache>.files``) that maps id -> absolute
  path + (st_dev, st_ino); a file replaced or deleted under its path no longer matches its row, so
  its entries miss without reading anything.
* **Every hit is verified**: the block is read from the referenced file and its full BLAKE3 hash
  compared with the one asked for. A failed check (data changed, file gone or replaced, offset
  beyond the end) clears the entry and counts as an invalidation and a miss. Files may therefore
  change at will, nobody has to tell the cache, and a torn, stale or garbage entry can only cost a
  miss: no returned block was not hashed by this process and found equal to the hash asked for.
* **Insertion** goes to an entry with the same key if there is one (it is re-pointed), else to an
  empty slot (searched from a random position), else evicts the entry with the lowest use count
  among ``evict_sample`` entries of the bucket chosen at random; a hit increments the entry's use
  count.
* **Read-ahead**: a hit reads the block and the blocks after it in one pread and primes a bounded
  in-memory LRU, keyed by the hash of each primed block (computed from the data itself, so a
  primed block is verified by construction, whichever file a later lookup's entry points to). Runs
  of blocks shared between two files then cost one disk access per window. The window is adaptive
  per file, like the kernel's: it starts at 8 blocks, doubles (up to ``readahead``, default 64)
  on every hit served from it, and falls back to 8 after a window nobody used, so random lookups
  do not pay for reading and hashing 64 blocks each.

Entry layout (32 bytes, little-endian; 128 per bucket)::

    0  8s  key      first 8 bytes of the hash (all-zero means the slot is empty; a hash whose first
                    8 bytes are zero is stored with key 01 00 .. 00)
    8  u64 offset   byte offset of the block in the file
    16 u32 file id  row of the path table (never 0)
    20 u32 check    CRC-32 of bytes 0..20 (key, offset, file id)
    24 u32 uses     hits served by this entry (saturating)
    28 u32 reserved

Concurrency and crashes
-----------------------

No lock is taken on the hot path. A writer clears an entry's key, writes the rest of the entry
(with its check word), then writes the key: a reader sees an empty slot, the old entry, or a mix
the check word rejects, and even a mix the check word missed (or a crash-torn entry, or a file
rewritten under the cache) cannot produce wrong data, because a block is only returned after its
full 32-byte hash matched. Two writers racing on one slot lose one of the two entries (a future
miss), which is why eviction samples slots at random, as in the paper. Use counts are updated
without atomicity: a lost increment only skews eviction. Statistics are per-process deltas merged
into the statistics page under a POSIX record lock at most every second or 4096 operations (and on
:meth:`HashCache.stats` / :meth:`HashCache.close`); a crash loses at most that much. Path-table rows
are committed before any entry refers to them, and ids are random, so an entry whose row was lost or
deleted simply misses. The header is written, fsynced and only then linked into place, so a cache
file is never seen half-created.

A HashCache object may be shared by the threads of one process (its methods serialise on an
internal lock); for parallel I/O open one per thread or process: they share the file without locks.
Do not use one across ``fork``: open it again in the child.

Measured on one core of the development VM, data in the page cache (``bench/hashcache_micro.py``):
a hit verified from disk ~10 us (~100k/s), a hit served from read-ahead ~4 us (~260k/s), a miss
~2 us (~480k/s), ``insert_file`` ~4 us per block (~1.1 GB/s of data indexed), ``prime_paths``
~700 MB/s, counting used entries of a 64 MiB cache ~22 ms.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import random
import sqlite3
import stat
import struct
import tempfile
import threading
import time
import uuid
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

from hashcache.blocks import ALGORITHM, BLOCK_SIZE, HASH_SIZE, ZERO_BLOCK, scan_blocks
from hashcache.errors import HashcacheError
from hashcache.manifest import KIND_LAYER, Manifest, _data_extents
from hashcache.qcow2 import DATA, Qcow2Image

__all__ = [
    "DEFAULT_SIZE",
    "CacheEntry",
    "CacheError",
    "HashCache",
    "PrimeResult",
    "remove_cache",
]


class CacheError(HashcacheError):
    """A hash cache file (or its path table) is missing, corrupt, foreign or unusable.

    The message names the file; a cache holds nothing that cannot be rebuilt, so the remedy offered
    is always to delete it.
    """


# -- format ------------------------------------------------------------------------------------------

MAGIC = b"CAPSULE-HCACHE\n\x00"
FORMAT_VERSION = 1
PAGE_SIZE = 4096
BUCKET_SIZE = 4096
ENTRY_SIZE = 32
ENTRIES_PER_BUCKET = BUCKET_SIZE // ENTRY_SIZE  # 128
KEY_SIZE = 8
STATS_OFFSET = PAGE_SIZE
BUCKETS_OFFSET = 2 * PAGE_SIZE

DEFAULT_SIZE = 64 * 1024 * 1024  # 16382 buckets, ~2.1M entries, indexes ~8 GiB of blocks
MIN_SIZE = BUCKETS_OFFSET + BUCKET_SIZE  # one bucket
MAX_SIZE = 1 << 40
DEFAULT_EVICT_SAMPLE = 16
DEFAULT_READAHEAD = 64  # at most this many blocks read after a hit, in the same pread (256 KiB)
READAHEAD_INITIAL = 8  # the first window of a file, and the window after an unused one
DEFAULT_READAHEAD_CAPACITY = 1024  # primed blocks kept in memory (4 MiB)

#: Bytes read (and hashed) per system call by prime_paths.
PRIME_CHUNK = 8 * 1024 * 1024

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``."""

# magic, version, page size, bucket size, entry size, entries per bucket, block size, key size,
# bucket count, file size, buckets offset, created (ns), evict sample, requested size, uuid, algorithm
_HEADER = struct.Struct("<16sIIIIIIIQQQQIQ16s16s")
_HEADER_SUM = 16  # BLAKE3 of the header fields, truncated, stored right after them
_STAT_NAMES = ("inserts", "updates", "hits", "readahead_hits", "misses", "evictions", "invalidations")
_STATS = struct.Struct(f"<{len(_STAT_NAMES)}Q")
(_INSERTS, _UPDATES, _HITS, _RA_HITS, _MISSES, _EVICTIONS, _INVALIDATIONS) = range(len(_STAT_NAMES))

_CHECKED = struct.Struct("<8sQI")  # key, offset, file id: the bytes the check word covers
_HEAD = struct.Struct("<8sQII")  # key, offset, file id, check
_TAIL = struct.Struct("<QIIII")  # offset, file id, check, uses, reserved: the entry after its key
_ENTRY = struct.Struct("<8sQIIII")
_U32 = struct.Struct("<I")
_ZERO8 = bytes(KEY_SIZE)
_ONE8 = b"\x01" + bytes(KEY_SIZE - 1)
_MAX_USES = 0xFFFF_FFFF
_MASK64 = (1 << 64) - 1
_ZERO_HASH = blake3(ZERO_BLOCK).digest()
_FLUSH_OPS = 4096
_FLUSH_SECONDS = 1.0
_MAX_OPEN_FILES = 64
_UNAVAILABLE = b""  # _read_verified: the file cannot be read right now; not a reason to drop the entry
_MAX_DEAD_IDS = 65536

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY,
    path TEXT NOT NULL UNIQUE,
    dev INTEGER NOT NULL,
    ino INTEGER NOT NULL,
    primed_size INTEGER,
    primed_mtime_ns INTEGER
);
"""

# One process-wide lock for the statistics page: POSIX record locks do not exclude threads of one
# process, and closing any descriptor of a file drops all of the process's locks on it.
_STATS_LOCK = threading.Lock()


def _key(h: bytes) -> bytes:
    k = h[:KEY_SIZE]
    return k if k != _ZERO8 else _ONE8


def _s64(n: int) -> int:
    """st_dev / st_ino as a signed 64-bit integer (what SQLite stores)."""
    n &= _MASK64
    return n - (1 << 64) if n >= 1 << 63 else n


def _check_hash(h: object) -> bytes:
    if type(h) is not bytes or len(h) != HASH_SIZE:
        if isinstance(h, bytearray | memoryview) and len(h) == HASH_SIZE:
            return bytes(h)
        raise ValueError(f"a block hash is {HASH_SIZE} bytes, got {h!r:.80}")
    return h


def _paths_db(path: str) -> str:
    return path + ".files"


def remove_cache(path: str | os.PathLike[str]) -> None:
    """Delete a hash cache file and its path table (it is recreated empty on the next open)."""
    path = os.path.abspath(os.fspath(path))
    db = _paths_db(path)
    for p in (path, db, db + "-wal", db + "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


# -- results ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheEntry:
    """One table entry, as :meth:`HashCache.peek` reports it (nothing verified)."""

    position: int  # byte offset of the entry in the cache file
    file_id: int
    path: str | None  # None if the path table does not know the id
    offset: int
    uses: int
    intact: bool  # the check word matches


@dataclass
class PrimeResult:
    """What :meth:`HashCache.prime_paths` did."""

    files: int = 0  # files read and indexed
    skipped: int = 0  # files unchanged since they were last indexed
    blocks: int = 0  # non-zero blocks inserted
    bytes_read: int = 0
    errors: list[str] = field(default_factory=list)  # "path: reason" for files that could not be read


# -- the cache -------------------------------------------------------------------------------------


class HashCache:
    """An open hash cache. Create or open one with :meth:`HashCache.open`; close it (or use ``with``)."""

    # -- opening ----------------------------------------------------------------------------------

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

    # -- files ------------------------------------------------------------------------------------

    def file_id(self, path: str | os.PathLike[str]) -> int:
        """The path table id of a regular file (registered if new). OSError if it cannot be stat'ed."""
        with self._lock:
            self._check_open()
            real = os.path.abspath(os.fspath(path))  # not realpath: one lstat per component
            st = os.stat(real)
            if not stat.S_ISREG(st.st_mode):
                raise HashcacheError(f"{real}: not a regular file; only regular files can be cached")
            try:
                return self._register(real, st)
            except sqlite3.Error as e:
                raise CacheError(f"hash cache path table {self.paths_path}: cannot register {real}: {e}") from e

    def forget_path(self, path: str | os.PathLike[str]) -> bool:
        """Drop a path from the path table: its entries miss from now on (e.g. before deleting it)."""
        with self._lock:
            self._check_open()
            real = os.path.abspath(os.fspath(path))
            row = self._db.execute("SELECT id FROM files WHERE path = ?", (real,)).fetchone()
            self._path_ids.pop(real, None)
            if row is None:
                return False
            self._drop_file(row[0], delete_row=False)
            with self._tx():
                self._db.execute("DELETE FROM files WHERE id = ?", (row[0],))
            return True

    def _register(self, real: str, st: os.stat_result) -> int:
        dev, ino = _s64(st.st_dev), _s64(st.st_ino)
        known = self._path_ids.get(real)
        if known is not None and known[1] == dev and known[2] == ino:
            return known[0]
        row = self._db.execute("SELECT id, dev, ino FROM files WHERE path = ?", (real,)).fetchone()
        if row is None or (row[1], row[2]) != (dev, ino):
            with self._tx():
                row = self._db.execute("SELECT id, dev, ino FROM files WHERE path = ?", (real,)).fetchone()
                if row is not None and (row[1], row[2]) != (dev, ino):
                    # Another file now lives at this path: the old id's entries must miss.
                    self._db.execute("DELETE FROM files WHERE id = ?", (row[0],))
                    self._drop_file(row[0], delete_row=False)
                    row = None
                if row is None:
                    while True:
                        fid = self._rng.getrandbits(32)
                        if not fid:
                            continue
                        try:
                            self._db.execute(
                                "INSERT INTO files (id, path, dev, ino) VALUES (?, ?, ?, ?)", (fid, real, dev, ino)
                            )
                        except sqlite3.IntegrityError:
                            if self._db.execute("SELECT 1 FROM files WHERE path = ?", (real,)).fetchone():
                                raise  # pragma: no cover - impossible inside the write transaction
                            continue  # id taken: draw another
                        break
                    row = (fid, dev, ino)
        fid = row[0]
        self._path_ids[real] = (fid, dev, ino)
        self._files[fid] = (real, dev, ino)
        self._dead.discard(fid)
        return fid

    def _file_info(self, fid: int) -> tuple[str, int, int] | None:
        info = self._files.get(fid)
        if info is None:
            try:
                row = self._db.execute("SELECT path, dev, ino FROM files WHERE id = ?", (fid,)).fetchone()
            except sqlite3.Error:
                return None
            if row is None:
                return None
            info = self._files[fid] = (row[0], row[1], row[2])
        return info

    def _drop_file(self, fid: int, delete_row: bool) -> None:
        """The file behind ``fid`` is gone or replaced: forget it (and, if asked, its row)."""
        fd = self._fds.pop(fid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        info = self._files.pop(fid, None)
        if len(self._dead) >= _MAX_DEAD_IDS:
            self._dead.clear()
        self._dead.add(fid)
        if info is not None:
            known = self._path_ids.get(info[0])
            if known is not None and known[0] == fid:
                del self._path_ids[info[0]]
            if delete_row:
                with contextlib.suppress(sqlite3.Error):  # best effort: the row only costs a stat
                    self._db.execute("DELETE FROM files WHERE id = ? AND dev = ? AND ino = ?", (fid, info[1], info[2]))

    def _fd_for(self, fid: int, validated: set[int]) -> int | None:
        """An open descriptor on the file ``fid`` names, if that file is still the one registered."""
        if fid in self._dead:
            return None
        info = self._file_info(fid)
        if info is None:  # no such row: the file was forgotten or replaced (or the entry is garbage)
            self._drop_file(fid, delete_row=False)
            return None
        path, dev, ino = info
        fds = self._fds
        fd = fds.get(fid)
        if fd is not None:
            if fid not in validated:
                try:
                    st = os.stat(path)
                except OSError:
                    st = None
                if st is None or _s64(st.st_dev) != dev or _s64(st.st_ino) != ino:
                    self._drop_file(fid, delete_row=True)
                    return None
                validated.add(fid)
            fds.move_to_end(fid)
            return fd
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            self._drop_file(fid, delete_row=True)
            return None
        except OSError:
            return None  # unreadable for now (permissions, EMFILE): a miss, not an invalidation
        try:
            st = os.fstat(fd)
        except OSError:  # pragma: no cover
            os.close(fd)
            return None
        if not stat.S_ISREG(st.st_mode) or _s64(st.st_dev) != dev or _s64(st.st_ino) != ino:
            os.close(fd)
            self._drop_file(fid, delete_row=True)
            return None
        fds[fid] = fd
        validated.add(fid)
        while len(fds) > _MAX_OPEN_FILES:
            _, old = fds.popitem(last=False)
            with contextlib.suppress(OSError):
                os.close(old)
        return fd

    # -- the table --------------------------------------------------------------------------------

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

    # -- inserting --------------------------------------------------------------------------------

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
            put = self._put
            for h, file, offset in items:
                h = _check_hash(h)
                if not 0 <= offset < 1 << 63:
                    raise ValueError(f"offset {offset} out of range")
                if h != _ZERO_HASH:
                    written += put(h, self._resolve(file, ids), offset)
            self._maybe_flush()
        return written

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
        written = 0
        with self._lock:
            self._check_open()
            fid = self.file_id(path)
            put = self._put
            for h, off in self._block_offsets(os.fspath(path), hashes):
                if h != _ZERO_HASH:
                    written += put(_check_hash(h), fid, off)
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

    def _resolve(self, file: str | os.PathLike[str] | int, ids: dict[object, int]) -> int:
        if isinstance(file, int):
            if not 0 < file < 1 << 32:
                raise ValueError(f"file id {file} out of range")
            return file
        fid = ids.get(file)
        if fid is None:
            fid = ids[file] = self.file_id(file)
        return fid

    # -- looking up -------------------------------------------------------------------------------

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

    # -- indexing existing files ------------------------------------------------------------------

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
            put = self._put
            zero_hash = _ZERO_HASH
            for start, end in _data_extents(fd, size):
                for off in range(start, end, PRIME_CHUNK):
                    n = min(PRIME_CHUNK, end - off)
                    view = whole[:n]
                    got = _read_upto(fd, view, off)
                    result.bytes_read += got
                    for i, h in enumerate(scan_blocks(view, got)):
                        if h is not None and h != zero_hash:
                            result.blocks += put(h, fid, off + i * BLOCK_SIZE)
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

    # -- statistics -------------------------------------------------------------------------------

    def _count(self, which: int) -> None:
        self._delta[which] += 1
        self._ops += 1

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

    # -- helpers ----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CacheError(f"hash cache {self.path}: already closed")

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise CacheError(f"hash cache path table {self.paths_path}: {e}") from e
        try:
            yield
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")


def _find_zero_key(keys: bytes, start: int, end: int) -> int:
    """Byte position of the first all-zero key (8 bytes at a multiple of 8) within ``keys[start:end]``, or -1."""
    pos = keys.find(_ZERO8, start, end)
    while pos >= 0 and pos % KEY_SIZE:
        pos = keys.find(_ZERO8, pos + 1, end)
    return pos


def _read_upto(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; fewer bytes only at the end of the file. Returns the count."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


# -- creating and checking the file --------------------------------------------------------------------


def _create_file(path: str, size_bytes: int, evict_sample: int | None) -> None:
    """Create a cache file atomically: build it under a temporary name, fsync, then link it into place."""
    if type(size_bytes) is not int or not MIN_SIZE <= size_bytes <= MAX_SIZE:
        raise ValueError(f"hash cache size must be between {MIN_SIZE} and {MAX_SIZE} bytes, not {size_bytes!r}")
    file_size = size_bytes // PAGE_SIZE * PAGE_SIZE
    buckets = (file_size - BUCKETS_OFFSET) // BUCKET_SIZE
    fields = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        PAGE_SIZE,
        BUCKET_SIZE,
        ENTRY_SIZE,
        ENTRIES_PER_BUCKET,
        BLOCK_SIZE,
        KEY_SIZE,
        buckets,
        file_size,
        BUCKETS_OFFSET,
        time.time_ns(),
        DEFAULT_EVICT_SAMPLE if evict_sample is None else evict_sample,
        size_bytes,
        uuid.uuid4().bytes,
        ALGORITHM.encode().ljust(16, b"\0"),
    )
    header = fields + blake3(fields).digest()[:_HEADER_SUM]
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    except OSError as e:
        raise CacheError(f"hash cache {path}: cannot create: {e.strerror or e}") from e
    try:
        try:
            os.fchmod(fd, 0o644)
            # Reserve the space now: a write through the map into a hole of a full disk is SIGBUS.
            os.posix_fallocate(fd, 0, file_size)
            os.pwrite(fd, header, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # someone else created it first: theirs wins
            os.link(tmp, path)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        raise CacheError(f"hash cache {path}: cannot create ({file_size} bytes): {e.strerror or e}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _corrupt(path: str, reason: str) -> CacheError:
    return CacheError(
        f"hash cache {path}: {reason}; it holds nothing that cannot be rebuilt: delete it "
        f"(and {_paths_db(path)}) and it is recreated empty on the next use"
    )


def _read_header(fd: int, path: str) -> dict[str, Any]:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CacheError(f"hash cache {path}: not a regular file")
    raw = os.pread(fd, _HEADER.size + _HEADER_SUM, 0)
    if len(raw) < len(MAGIC) or not raw.startswith(MAGIC):
        raise _corrupt(path, "not a hash cache (bad magic)")
    if len(raw) < _HEADER.size + _HEADER_SUM:
        raise _corrupt(path, "truncated inside the header")
    fields = raw[: _HEADER.size]
    (
        _magic,
        version,
        page_size,
        bucket_size,
        entry_size,
        per_bucket,
        block_size,
        key_size,
        buckets,
        file_size,
        buckets_offset,
        created_ns,
        evict_sample,
        _requested,
        uid,
        algorithm,
    ) = _HEADER.unpack(fields)
    if version != FORMAT_VERSION:
        raise _corrupt(path, f"format version {version} is not supported (this code reads {FORMAT_VERSION})")
    if blake3(fields).digest()[:_HEADER_SUM] != raw[_HEADER.size :]:
        raise _corrupt(path, "header checksum mismatch (the header is corrupt)")
    geometry = (page_size, bucket_size, entry_size, per_bucket, block_size, key_size, buckets_offset)
    expected = (PAGE_SIZE, BUCKET_SIZE, ENTRY_SIZE, ENTRIES_PER_BUCKET, BLOCK_SIZE, KEY_SIZE, BUCKETS_OFFSET)
    if geometry != expected or algorithm.rstrip(b"\0") != ALGORITHM.encode():
        raise _corrupt(path, f"unsupported geometry {geometry} / algorithm {algorithm!r}")
    if buckets < 1 or file_size != BUCKETS_OFFSET + buckets * BUCKET_SIZE or not 1 <= evict_sample <= per_bucket:
        raise _corrupt(path, f"inconsistent header ({buckets} buckets, {file_size} bytes)")
    if st.st_size != file_size:
        raise _corrupt(path, f"file is {st.st_size} bytes but its header says {file_size} (truncated?)")
    return {
        "file_size": file_size,
        "bucket_count": buckets,
        "created_ns": created_ns,
        "evict_sample": evict_sample,
        "uuid": uuid.UUID(bytes=uid).hex,
    }


def _open_paths_db(db_path: str, cache_uuid: str) -> sqlite3.Connection:
    """Open (or create) the path table; reset it if it belonged to an earlier cache file."""
    try:
        db = sqlite3.connect(db_path, timeout=30.0, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as e:
        raise CacheError(f"hash cache path table {db_path}: cannot open: {e}") from e
    try:
        for attempt in range(50):
            try:
                if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as e:  # another process is switching it right now
                if "locked" not in str(e) or attempt == 49:
                    raise
                time.sleep(0.02)
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            row = db.execute("SELECT value FROM meta WHERE key = 'cache_uuid'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta (key, value) VALUES ('cache_uuid', ?)", (cache_uuid,))
            elif row[0] != cache_uuid:
                # Left over from a deleted cache file: its ids mean nothing to this one.
                db.execute("DELETE FROM files")
                db.execute("UPDATE meta SET value = ? WHERE key = 'cache_uuid'", (cache_uuid,))
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
    except sqlite3.DatabaseError as e:
        db.close()
        raise CacheError(
            f"hash cache path table {db_path}: {e}; delete it (and the cache file next to it) and it is "
            "recreated empty on the next use"
        ) from e
    return db
