"""What the parts of :class:`HashCache` share: the state its constructor sets and the methods each part
calls on another, declared once so each part type-checks on its own. Declarations only: nothing
here runs (the facade's ``__init__`` sets the attributes; the parts define the methods)."""

from __future__ import annotations

import mmap
import os
import random
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING


class CacheState:
    """Base of every part of :class:`HashCache` (see the module docstring)."""

    path: str
    paths_path: str
    size_bytes: int
    bucket_count: int
    capacity: int
    created_ns: int
    uuid: str
    readahead: int
    readahead_capacity: int
    evict_sample: int
    disk_reads: int
    _fd: int
    _mm: mmap.mmap
    _q: memoryview
    _db: sqlite3.Connection
    _lock: threading.RLock
    _rng: random.Random
    _files: dict[int, tuple[str, int, int]]
    _path_ids: dict[str, tuple[int, int, int]]
    _dead: set[int]
    _fds: OrderedDict[int, int]
    _primed: OrderedDict[bytes, tuple[bytes, int, int]]
    _primed_prefix: dict[bytes, bytes]
    _windows: dict[int, list[int]]
    _delta: list[int]
    _ops: int
    _last_flush: float
    _closed: bool

    if TYPE_CHECKING:
        # the facade (facade.py)
        def _check_open(self) -> None: ...
        def _count(self, which: int, n: int = 1) -> None: ...
        def _maybe_flush(self) -> None: ...
        def _flush_stats(self) -> None: ...

        # the file registry (registry.py)
        def file_id(self, path: str | os.PathLike[str]) -> int: ...
        def _register(self, real: str, st: os.stat_result) -> int: ...
        def _file_info(self, fid: int) -> tuple[str, int, int] | None: ...
        def _fd_for(self, fid: int, validated: set[int]) -> int | None: ...
        def _tx(self) -> AbstractContextManager[None]: ...

        # the bucket table (table.py)
        def _candidates(self, h: bytes) -> list[tuple[int, bytes, int, int]]: ...
        def _invalidate(self, pos: int, head: bytes) -> None: ...
        def _bump_uses(self, pos: int) -> None: ...
        def _put(self, h: bytes, fid: int, off: int) -> bool: ...
        def _put_many(self, items: Iterable[tuple[bytes, int, int]]) -> int: ...
