"""Fetching missing blocks of remote layers: claimed so no block is fetched twice, taken from the hash
cache or the source (HCP READ, with read-ahead on sequential reads), verified against the manifest;
and prefetch, which pulls everything left at low priority."""

from __future__ import annotations

import threading
import time

from blake3 import blake3

from diskserver.chain.layers import (
    Progress,
    _Flight,
    _Layer,
    log,
)
from diskserver.chain.state import ChainState
from diskserver.errors import BlockMismatch, DiskServerError, SourceError
from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import HashcacheError
from hashcache.hcp import MAX_BATCH


class Fetching(ChainState):
    """Part of :class:`Chain`: obtaining blocks, read-ahead and prefetch."""

    def _note_request(self, first: int, end: int) -> int:
        """Read-ahead window (blocks) for this request.

        A request is sequential when it starts exactly where one of the last few requests ended (a
        few, because a client with several requests in flight reorders them). The window is 0 for
        random reads; it starts at ``min_blocks`` on the first sequential request and doubles per
        sequential request up to ``max_blocks``. Lock-free: a race only perturbs the heuristic."""
        ra = self.spec.readahead
        if self._fastmap is not None:  # the state the native read path's hits advance too
            return self._fastmap.note(first, end, ra)
        window = self._ra_window = ra.window(first in self._ra_ends, self._ra_window)
        self._ra_ends.append(end)
        return window

    def _readahead(self, layer: _Layer, end: int, window: int) -> list[int]:
        """Blocks after the request owned by ``layer`` and not yet local, within ``window`` blocks."""
        owner = self._owner
        pos = layer.pos
        stop = min(end + window, self.nblocks)
        pending = layer.pending
        return [j for j in range(end, stop) if owner[j] == pos and not layer.has(j) and j not in pending]

    def _obtain(self, layer: _Layer, want: list[int], extra: list[int], *, prefetch: bool,
                need_data: bool) -> dict[int, bytes]:
        """Make sure every block of ``want`` is in the shadow or in memory; also try ``extra`` (read-ahead).

        Returns data held in memory for blocks of ``want`` (if ``need_data``); the others are present in
        the shadow. Raises if a block of ``want`` cannot be obtained."""
        result: dict[int, bytes] = {}
        todo = list(want)
        wanted = set(want)
        for attempt in range(4):
            claimed: list[int] = []
            waits: list[_Flight] = []
            flight = _Flight(prefetch)
            with self._lock:
                pending = layer.pending
                candidates = todo + extra if attempt == 0 else todo
                for j in candidates:
                    d = pending.get(j)
                    if d is not None:
                        if need_data and j in wanted:
                            result[j] = d
                        continue
                    if layer.has(j):
                        continue
                    key = (layer.pos, j)
                    other = self._inflight.get(key)
                    if other is not None and (prefetch or not other.prefetch):
                        if j in wanted:
                            waits.append(other)
                        continue
                    self._inflight[key] = flight
                    claimed.append(j)
            if claimed:
                try:
                    fetched = self._fetch(layer, sorted(claimed), wanted, prefetch)
                finally:
                    with self._lock:
                        for j in claimed:
                            if self._inflight.get((layer.pos, j)) is flight:
                                del self._inflight[(layer.pos, j)]
                    flight.done.set()
                if need_data:
                    for j, d in fetched.items():
                        if j in wanted:
                            result[j] = d
            deadline = time.monotonic() + self.spec.retry.seconds + self.spec.retry.request_timeout + 5
            for w in {id(w): w for w in waits}.values():
                w.done.wait(max(0.0, deadline - time.monotonic()))
            # What is still neither in memory nor present (e.g. another thread's fetch failed)?
            todo = [j for j in todo if j not in result and not layer.has(j)]
            if todo:
                if attempt:  # the shadow may have it from another process
                    self._refresh_presence(layer, todo)
                    todo = [j for j in todo if not layer.has(j)]
                if todo and need_data:
                    with self._lock:
                        for j in todo:
                            d = layer.pending.get(j)
                            if d is not None:
                                result[j] = d
                    todo = [j for j in todo if j not in result]
                elif todo:
                    with self._lock:
                        todo = [j for j in todo if j not in layer.pending]
            if not todo:
                return result
        raise DiskServerError(f"layer {layer.id[:12]}: block {todo[0]} could not be obtained "
                              f"({len(todo)} block(s) missing)")

    def _fetch(self, layer: _Layer, claimed: list[int], wanted: set[int], prefetch: bool) -> dict[int, bytes]:
        """Obtain claimed blocks from the hash cache, else the source; verify; keep. Returns the data."""
        hashes = {j: layer.hash_of(j) for j in claimed}
        out: dict[int, bytes] = {}
        from_cache = 0
        if self._cache is not None:
            try:
                found = self._cache.lookup_many([hashes[j] for j in claimed])
            except (HashcacheError, OSError) as exc:
                log.warning("hash cache lookup failed (%s); fetching from the source", exc)
                found = [None] * len(claimed)
            for j, d in zip(claimed, found, strict=True):
                if d is not None and len(d) == BLOCK_SIZE and blake3(d).digest() == hashes[j]:
                    out[j] = d
                    from_cache += 1
        rest = [j for j in claimed if j not in out]
        fetched: list[int] = []  # blocks that came from the source (to record in the hash cache)
        dedup = 0
        error: Exception | None = None
        if rest:
            assert layer.source is not None
            by_hash: dict[bytes, list[int]] = {}
            for j in rest:
                by_hash.setdefault(hashes[j], []).append(j)
            # one block per distinct hash; an asked-for one when there is one
            unique = sorted(min(ix, key=lambda j: (j not in wanted, j)) for ix in by_hash.values())
            # Asked-for blocks first, so a failure of a read-ahead batch cannot hold them up.
            first = [j for j in unique if j in wanted]
            later = [j for j in unique if j not in wanted]
            batches = [first[k:k + MAX_BATCH] for k in range(0, len(first), MAX_BATCH)]
            if later and batches and len(batches[-1]) + len(later) <= MAX_BATCH:
                batches[-1] = sorted(batches[-1] + later)
            else:
                batches += [later[k:k + MAX_BATCH] for k in range(0, len(later), MAX_BATCH)]
            for batch in batches:
                try:
                    res = layer.source.read_blocks(layer.id, batch)
                except SourceError as exc:
                    self._count(fetch_errors=1)
                    error = exc
                    break
                self._count(fetch_requests=1, fetch_attempts=res.attempts, wire_bytes=res.wire_bytes,
                            source_blocks=len(batch), source_bytes=len(batch) * BLOCK_SIZE)
                bad = []
                for j, d in zip(batch, res.blocks, strict=True):
                    h = hashes[j]
                    if blake3(d).digest() != h:
                        bad.append(j)
                        continue
                    out[j] = d
                    fetched.append(j)
                    for k in by_hash[h]:
                        if k != j:
                            out[k] = d
                            dedup += 1
                if bad:
                    self._count(verify_failures=len(bad))
                    url = layer.source.url
                    error = BlockMismatch(
                        f"layer {layer.id}: block {bad[0]} from {url} does not match its manifest hash"
                        + (f" ({len(bad)} blocks wrong)" if len(bad) > 1 else "")
                        + "; it was neither served nor stored", layer_id=layer.id, block=bad[0])
                    log.error("%s", error)
                    break
        if out:
            self._keep(layer, out, [(hashes[j], j) for j in fetched])
        n_extra = sum(1 for j in out if j not in wanted)
        self._count(cache_blocks=from_cache, dedup_blocks=dedup,
                    **({"prefetch_blocks": len(out)} if prefetch else {"readahead_blocks": n_extra}))
        if error is not None:
            missing_wanted = [j for j in claimed if j in wanted and j not in out]
            if missing_wanted or prefetch:
                if not isinstance(error, BlockMismatch):
                    log.error("%s", error)
                self._last_error = str(error)
                raise error
            log.warning("read-ahead of layer %s failed (the blocks asked for arrived): %s", layer.id[:12], error)
        return out

    def _visible(self, layer: _Layer, index: int) -> bool:
        return index < self.nblocks and self._owner[index] == layer.pos

    def _missing(self, layer: _Layer, visible_only: bool) -> list[int]:
        with self._lock:
            pending = set(layer.pending)
        out = [j for j in layer.data_blocks if not layer.has(j) and j not in pending]
        if out:
            self._refresh_presence(layer, out)
            out = [j for j in out if not layer.has(j)]
        if visible_only:
            out = [j for j in out if self._visible(layer, j)]
        return out

    def remaining_bytes(self, visible_only: bool = False) -> int:
        """Bytes of remote layers' data blocks not yet local (``visible_only``: only blocks the chain shows)."""
        return sum(len(self._missing(layer, visible_only)) for layer in self.layers if not layer.local) * BLOCK_SIZE

    def complete(self, visible_only: bool = False) -> bool:
        """True when every data block of every remote layer is in its shadow (no read needs a source)."""
        self.flush()
        return self.remaining_bytes(visible_only) == 0

    def _yield_to_foreground(self, stop_event: threading.Event | None, idle: float = 0.02) -> None:
        while not (stop_event is not None and stop_event.is_set()) and not self._stopping.is_set():
            if self._fg_busy == 0 and time.monotonic() - self._fg_last >= idle:
                return
            time.sleep(0.005)

    def prefetch(self, progress: Progress | None = None, stop_event: threading.Event | None = None,
                 visible_only: bool = False) -> int:
        """Pull every remaining block of every remote layer (blocks the chain shows first), at low priority.

        Works in batches of ``prefetch_batch_blocks``, waiting while foreground reads are missing. Uses
        the hash cache before the source. Returns the number of blocks obtained; stops early (without
        error) when ``stop_event`` is set; raises if a source stays unreachable or sends a wrong block.
        """
        plan: list[tuple[_Layer, list[int]]] = []
        for layer in self.layers:
            if layer.local:
                continue
            missing = self._missing(layer, False)
            vis = [j for j in missing if self._visible(layer, j)]
            plan.append((layer, vis))
            if not visible_only:
                plan.append((layer, [j for j in missing if not self._visible(layer, j)]))
        total = sum(len(ix) for _layer, ix in plan) * BLOCK_SIZE
        done = 0
        obtained = 0
        batch = self.spec.prefetch_batch_blocks
        if progress is not None:
            progress(0, total)
        for layer, indices in plan:
            for k in range(0, len(indices), batch):
                if (stop_event is not None and stop_event.is_set()) or self._stopping.is_set():
                    self.flush()
                    return obtained
                self._yield_to_foreground(stop_event)
                chunk = indices[k:k + batch]
                with self._lock:
                    todo = [j for j in chunk if not layer.has(j) and j not in layer.pending]
                if todo:
                    self._obtain(layer, todo, [], prefetch=True, need_data=False)
                    obtained += len(todo)
                done += len(chunk) * BLOCK_SIZE
                if progress is not None:
                    progress(done, total)
        self.flush()
        return obtained
