"""Persisting fetched blocks: write-behind (served from memory at once, written to the shadow by a
persister thread that fdatasyncs once per group before setting presence bits) or synchronously."""

from __future__ import annotations

import os
import time

from diskserver.chain.layers import (
    _PERSIST_LINGER,
    _SHIFT,
    _Layer,
    log,
)
from diskserver.chain.state import ChainState
from hashcache.errors import HashcacheError


class Persisting(ChainState):
    """Part of :class:`Chain`: the write-behind persister."""

    def _keep(self, layer: _Layer, blocks: dict[int, bytes], cache_items: list[tuple[bytes, int]]) -> None:
        """Store verified blocks: write-behind (memory now, shadow soon) or synchronously."""
        if not self.write_behind:
            self._persist(layer, blocks, cache_items)
            return
        with self._cv:
            while self._pending_total >= self.spec.max_pending_blocks and self._persister_alive():
                self._cv.wait(1.0)
            if not self._persister_alive():
                synchronous = True
            else:
                synchronous = False
                layer.pending.update(blocks)
                self._pending_total += len(blocks)
                self._queue.append((layer, blocks, [j for _h, j in cache_items]))
                self._cv.notify_all()
        if synchronous:
            self._persist(layer, blocks, cache_items)

    def _persister_alive(self) -> bool:
        return not self._stopping.is_set() and any(t.name == "diskserver-persist" and t.is_alive()
                                                   for t in self._threads)

    def _persist(self, layer: _Layer, blocks: dict[int, bytes], cache_items: list[tuple[bytes, int]]) -> bool:
        assert layer.shadow is not None
        try:
            layer.shadow.store(sorted(blocks.items()), durable=True)
        except (OSError, ValueError) as exc:
            log.error("layer %s: storing %d block(s) in the shadow failed: %s (they will be fetched again)",
                      layer.id[:12], len(blocks), exc)
            self._count(persist_errors=1)
            return False
        with self._lock:
            self._set_present(layer, blocks)
        self._count(persisted_blocks=len(blocks))
        if self._cache is not None and cache_items:
            data_path = os.fspath(layer.shadow.data_path)
            try:
                n = self._cache.insert_many((h, data_path, j << _SHIFT) for h, j in cache_items)
                self._count(cache_inserts=n)
            except (HashcacheError, OSError) as exc:
                log.warning("hash cache insert failed: %s", exc)
        return True

    def _persister(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping.is_set():
                    self._cv.wait()
                if not self._queue:
                    return
                # Linger a moment so that one wake-up persists a burst of misses: waking (and taking
                # the GIL) once per miss made every miss pay for the previous one's persisting.
                until = time.monotonic() + _PERSIST_LINGER
                while (self._pending_total < self.spec.max_pending_blocks // 2 and not self._flushing
                       and not self._stopping.is_set() and (left := until - time.monotonic()) > 0):
                    self._cv.wait(left)
                work = self._queue
                self._queue = []
                self._persisting += 1
            try:
                merged: dict[int, tuple[_Layer, dict[int, bytes], list[int]]] = {}
                for layer, blocks, cache_idx in work:
                    entry = merged.setdefault(layer.pos, (layer, {}, []))
                    entry[1].update(blocks)
                    entry[2].extend(cache_idx)
                for layer, blocks, cache_idx in merged.values():
                    items = [(layer.hash_of(j), j) for j in cache_idx]
                    self._persist(layer, blocks, items)
                    with self._cv:
                        for j in blocks:
                            layer.pending.pop(j, None)
                        self._pending_total -= len(blocks)
            except Exception:  # noqa: BLE001 - the persister must not die silently
                log.exception("the shadow persister failed")
            finally:
                with self._cv:
                    self._persisting -= 1
                    self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every fetched block is durable in its shadow. Returns False on timeout."""
        if not self.write_behind:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._flushing += 1  # the persister stops lingering
            self._cv.notify_all()
            try:
                while self._queue or self._persisting:
                    if not any(t.is_alive() for t in self._threads):
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cv.wait(left if left is not None else 1.0)
            finally:
                self._flushing -= 1
        return True
