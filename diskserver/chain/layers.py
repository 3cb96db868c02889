"""An open chain's layers and the small pieces every part of the chain shares: the counters,
in-flight markers, presence bitmaps in memory, full reads and zero fills."""

from __future__ import annotations

import logging
import os
import sys
import threading
from array import array
from collections.abc import Callable

from diskserver.chain.spec import LayerSpec
from diskserver.errors import DiskServerError
from diskserver.source import BlockSource
from hashcache.blocks import BLOCK_SIZE
from hashcache.manifest import RECORD_SIZE, Manifest
from hashcache.shadow import Shadow

log = logging.getLogger("diskserver")

_SHIFT = 12
assert 1 << _SHIFT == BLOCK_SIZE
_MASK = BLOCK_SIZE - 1
_ZEROS = memoryview(bytes(4 << 20))
_FF = b"\xff" * 4096

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``."""


_COUNTERS = (
    "requests",  # reads served (pread calls)
    "guest_bytes",  # bytes asked for by the client
    "zero_blocks",  # blocks served as zeros (owned by no layer, or zero-flagged): no I/O
    "local_blocks",  # blocks read from local layers
    "shadow_blocks",  # remote blocks asked for and already in their shadow
    "memory_blocks",  # remote blocks asked for and served from memory (fetched, not yet persisted)
    "miss_blocks",  # remote blocks asked for that were not local yet (a demand miss)
    "cache_blocks",  # blocks obtained from the hash cache (demand, read-ahead and prefetch)
    "source_blocks",  # blocks fetched from the source (demand, read-ahead and prefetch)
    "dedup_blocks",  # blocks copied from another block of the same batch with the same hash
    "readahead_blocks",  # blocks obtained beyond what was asked for (read-ahead)
    "prefetch_blocks",  # blocks obtained by prefetch
    "source_bytes",  # raw bytes of blocks fetched from the source (source_blocks * 4096)
    "wire_bytes",  # bytes of HCP requests and answers on the wire
    "fetch_requests",  # HCP READ requests that succeeded
    "fetch_attempts",  # HCP READ attempts, retries included
    "fetch_errors",  # fetches that failed (source unreachable after the retry window, refused, malformed)
    "verify_failures",  # fetched blocks that did not match their manifest hash
    "read_errors",  # reads that failed
    "persisted_blocks",  # blocks written durably to shadows by this process
    "persist_errors",  # failed shadow writes (the blocks are fetched again later)
    "cache_inserts",  # hash cache entries written for fetched blocks
    "miss_ns",  # time spent in reads that missed, total (ns)
)


class _Flight:
    """Blocks one thread is obtaining; others wait on ``done`` instead of fetching them again."""

    __slots__ = ("done", "prefetch")

    def __init__(self, prefetch: bool) -> None:
        self.done = threading.Event()
        self.prefetch = prefetch


class _Layer:
    """One layer of an open chain."""

    def __init__(self, pos: int, spec: LayerSpec, manifest: Manifest) -> None:
        self.pos = pos
        self.spec = spec
        self.id = spec.id
        self.manifest = manifest
        self.local = spec.is_local
        self.nblocks = manifest.block_count
        self.fd = -1  # local: the qcow2 file; remote: the shadow's data file
        self.shadow: Shadow | None = None
        self.source: BlockSource | None = None
        self.present = bytearray()  # remote: this process's view of the shadow's presence bitmap
        self.present_count = 0
        self.pending: dict[int, bytes] = {}  # remote: fetched, verified, not yet persisted
        keys = _record_keys(manifest)
        self.data_blocks = array("q", (k >> 1 for k in keys if not k & 1))

    def hash_of(self, index: int) -> bytes:
        found = self.manifest.record(index)
        if found is None or found[0]:
            raise DiskServerError(f"layer {self.id[:12]}: block {index} is not a data block of the layer")
        return found[1]

    def has(self, index: int) -> bool:
        return bool(self.present[index >> 3] & (1 << (index & 7)))

    def all_present(self, start: int, end: int) -> bool:
        """Every block in [start, end) present in this process's view (lock-free: bits are only ever set)."""
        p = self.present
        b = start
        while b < end and b & 7:
            if not p[b >> 3] & (1 << (b & 7)):
                return False
            b += 1
        full = end & ~7
        while b < full:
            n = min(full - b, len(_FF) * 8)
            if p[b >> 3:(b + n) >> 3] != _FF[: n >> 3]:
                return False
            b += n
        while b < end:
            if not p[b >> 3] & (1 << (b & 7)):
                return False
            b += 1
        return True


_PERSIST_LINGER = 0.02  # seconds the persister gathers fetched blocks before writing them


def _record_keys(m: Manifest) -> array[int]:
    keys = array("Q")
    if keys.itemsize == 8 and sys.byteorder == "little":
        keys.frombytes(memoryview(m.record_bytes).cast("Q")[:: RECORD_SIZE // 8].tobytes())
    else:  # pragma: no cover
        keys.extend(int.from_bytes(m.record_bytes[o:o + 8], "little") for o in range(0, len(m.record_bytes),
                                                                                       RECORD_SIZE))
    return keys


def _preadv_full(fd: int, view: memoryview, offset: int, what: str) -> None:
    done = 0
    n = len(view)
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise DiskServerError(f"{what}: unexpected end of file at offset {offset + done}")
        done += got


def _zero(view: memoryview) -> None:
    n = len(view)
    step = len(_ZEROS)
    for o in range(0, n, step):
        m = min(step, n - o)
        view[o:o + m] = _ZEROS[:m]

