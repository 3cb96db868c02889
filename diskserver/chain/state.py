"""What the parts of :class:`Chain` share: the state its constructor sets (and ``_resolve``, which
builds the owner map) and the methods each part calls on another, declared once so each part
type-checks on its own. Declarations only: nothing here runs."""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from diskserver.chain.fastmap import FastMap
from diskserver.chain.layers import _Flight, _Layer
from diskserver.chain.spec import ChainSpec
from diskserver.source import BlockSource
from hashcache.cache import HashCache


class ChainState:
    """Base of every part of :class:`Chain` (see the module docstring)."""

    spec: ChainSpec
    layers: list[_Layer]
    size: int
    nblocks: int
    write_behind: bool
    _cache: HashCache | None
    _sources: dict[tuple[str, str, str | None, str | None], BlockSource]  # (url, token file, pin, opener)
    _lock: threading.Lock
    _cv: threading.Condition
    _inflight: dict[tuple[int, int], _Flight]
    _queue: list[tuple[_Layer, dict[int, bytes], list[int]]]
    _pending_total: int
    _persisting: int
    _closed: bool
    _stopping: threading.Event
    _threads: list[threading.Thread]
    _fg_busy: int
    _fg_last: float
    _ra_ends: deque[int]
    _ra_window: int
    _fastmap: FastMap | None
    _flushing: int
    _last_error: str | None
    # the owner map (BlockResolution._resolve)
    _owner: array[int]
    _seg_start: array[int]
    _seg_owner: array[int]
    _seg_host: array[int]

    if TYPE_CHECKING:
        # the facade (facade.py)
        def _count(self, **kw: int) -> None: ...

        # resolution (resolve.py)
        def _refresh_presence(self, layer: _Layer, indices: Iterable[int]) -> int: ...
        def _set_present(self, layer: _Layer, indices: Iterable[int]) -> None: ...

        # fetching (fetch.py)
        def _readahead(self, layer: _Layer, end: int, window: int) -> list[int]: ...
        def _obtain(self, layer: _Layer, want: list[int], extra: list[int], *, prefetch: bool,
                    need_data: bool) -> dict[int, bytes]: ...

        # persisting (persist.py)
        def _keep(self, layer: _Layer, blocks: dict[int, bytes], cache_items: list[tuple[bytes, int]]) -> None: ...
        def flush(self, timeout: float | None = None) -> bool: ...
