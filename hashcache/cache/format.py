"""The hash cache file's format: constants, the header (created atomically, checked on open),
the entry layout and the small helpers every part shares. See the package docstring for the design."""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from hashcache.blocks import ALGORITHM, BLOCK_SIZE, HASH_SIZE, ZERO_BLOCK
from hashcache.errors import HashcacheError


class CacheError(HashcacheError):
    """A hash cache file (or its path table) is missing, corrupt, foreign or unusable.

    The message names the file; a cache holds nothing that cannot be rebuilt, so the remedy offered
    is always to delete it.
    """


# -- format ------------------------------------------------------------------------------------------

MAGIC = b"CAPSULE-HCACHE\n\x00"
CACHE_MODE = 0o600          # the cache file and its path table (whatever the umask)
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


def narrow_mode(path: str) -> None:
    """Make ``path`` (if it exists and is ours) its owner's alone: caches made before CACHE_MODE were 0644."""
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(path)
        if st.st_mode & 0o077 and st.st_uid == os.geteuid():
            os.chmod(path, CACHE_MODE)


def _paths_db(path: str) -> str:
    return path + ".files"


def remove_cache(path: str | os.PathLike[str]) -> None:
    """Delete a hash cache file and its path table (it is recreated empty on the next open)."""
    path = os.path.abspath(os.fspath(path))
    db = _paths_db(path)
    for p in (path, db, db + "-wal", db + "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


@dataclass(frozen=True)
class CacheEntry:
    """One table entry, as :meth:`HashCache.peek` reports it (nothing verified)."""

    position: int  # byte offset of the entry in the cache file
    file_id: int
    path: str | None  # None if the path table does not know the id
    offset: int
    uses: int
    intact: bool  # the check word matches


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
            os.fchmod(fd, CACHE_MODE)   # its owner's alone: it names every indexed file and its hashes
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

