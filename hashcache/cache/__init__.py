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

import os  # noqa: F401  (tests patch hashcache.cache.os)

from hashcache.cache.facade import HashCache
from hashcache.cache.format import (
    BUCKET_SIZE,
    BUCKETS_OFFSET,
    DEFAULT_READAHEAD,
    DEFAULT_READAHEAD_CAPACITY,
    DEFAULT_SIZE,
    ENTRIES_PER_BUCKET,
    ENTRY_SIZE,
    KEY_SIZE,
    MAGIC,
    PAGE_SIZE,
    PRIME_CHUNK,
    CacheEntry,
    CacheError,
    remove_cache,
)
from hashcache.cache.priming import PrimeResult

__all__ = [
    "BUCKETS_OFFSET",
    "BUCKET_SIZE",
    "DEFAULT_READAHEAD",
    "DEFAULT_READAHEAD_CAPACITY",
    "DEFAULT_SIZE",
    "ENTRIES_PER_BUCKET",
    "ENTRY_SIZE",
    "KEY_SIZE",
    "MAGIC",
    "PAGE_SIZE",
    "PRIME_CHUNK",
    "CacheEntry",
    "CacheError",
    "HashCache",
    "PrimeResult",
    "remove_cache",
]
