"""A small LRU of open things that several threads use at once (readers of sealed objects, the
shadows of objects being received).

A user holds an entry only inside ``with cache.lease(key) as value:``. Eviction (the LRU growing past
its size, or ``drop``) only takes the entry out of the cache: whoever returns its last lease closes
it. So nothing is closed under a thread that still reads or writes through it, and an entry opened
twice by two threads that missed at once is closed, not leaked."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Entry(Generic[V]):
    __slots__ = ("value", "refs", "evicted")

    def __init__(self, value: V) -> None:
        self.value = value
        self.refs = 1
        self.evicted = False


class LeaseCache(Generic[K, V]):
    def __init__(self, open_: Callable[[K], V], close: Callable[[V], None], size: int) -> None:
        if size < 1:
            raise ValueError("a lease cache holds at least one entry")
        self._open = open_
        self._close = close
        self.size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[K, _Entry[V]] = OrderedDict()
        self._closed = False

    @contextmanager
    def lease(self, key: K) -> Iterator[V]:
        entry = self._acquire(key)
        try:
            yield entry.value
        finally:
            self._release(entry)

    def drop(self, key: K) -> None:
        """Forget ``key``: the next lease opens it afresh; current holders keep theirs until they return it."""
        with self._lock:
            entry = self._entries.pop(key, None)
            close = entry is not None and self._evict(entry)
        if close:
            assert entry is not None
            self._close(entry.value)

    def close(self) -> None:
        """Drop every entry (those still leased are closed when their last holder returns them)."""
        with self._lock:
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
            idle = [e for e in entries if self._evict(e)]
        for e in idle:
            self._close(e.value)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # -- internals (the lock guards _entries and every entry's refs/evicted) ---------------------------

    def _lookup(self, key: K) -> _Entry[V] | None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.refs += 1
            self._entries.move_to_end(key)
        return entry

    @staticmethod
    def _evict(entry: _Entry[V]) -> bool:
        """Mark an entry that left the cache; True when nobody holds it (the caller closes it)."""
        entry.evicted = True
        return entry.refs == 0

    def _acquire(self, key: K) -> _Entry[V]:
        with self._lock:
            if self._closed:
                raise ValueError("the cache is closed")
            entry = self._lookup(key)
        if entry is not None:
            return entry
        value = self._open(key)  # outside the lock: opening reads files
        idle: list[V] = []
        with self._lock:
            entry = self._lookup(key)
            if entry is not None:  # another thread opened it meanwhile: use that one, close ours
                idle.append(value)
            else:
                entry = _Entry(value)
                if self._closed:
                    entry.evicted = True  # closed meanwhile: serve this one lease, then close it
                else:
                    self._entries[key] = entry
                while len(self._entries) > self.size:
                    _k, old = self._entries.popitem(last=False)
                    if self._evict(old):
                        idle.append(old.value)
        for v in idle:
            self._close(v)
        return entry

    def _release(self, entry: _Entry[V]) -> None:
        with self._lock:
            entry.refs -= 1
            close = entry.evicted and entry.refs == 0
        if close:
            self._close(entry.value)
