"""Block resolution: every guest block mapped once, at open, to the topmost layer that owns it (or to
zeros), as a segment map; reads served from local layers, shadows or memory along that map."""

from __future__ import annotations

import time
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator

from diskserver.chain.layers import (
    _MASK,
    _SHIFT,
    _Layer,
    _preadv_full,
    _record_keys,
    _zero,
)
from diskserver.chain.state import ChainState
from diskserver.errors import DiskServerError, SpecError
from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import HashcacheError
from hashcache.hcp import MAX_BATCH
from hashcache.qcow2 import DATA, Qcow2Image


class BlockResolution(ChainState):
    """Part of :class:`Chain`: the owner map and reading along it."""

    def _local_offsets(self, layer: _Layer) -> array[int]:
        """Host offset of every block the local layer allocates as data (-1: zero, -2: not allocated)."""
        path = layer.spec.local_path
        host = array("q", [-2]) * layer.nblocks
        allocated = 0
        try:
            with Qcow2Image(path) as img:  # type: ignore[arg-type]
                if img.block_count != layer.nblocks:
                    raise SpecError(f"layer {layer.id[:12]}: {path} has {img.virtual_size} bytes, its manifest "
                                    f"says {layer.manifest.size}")
                for run in img.iter_block_runs(max_blocks=1 << 20):
                    allocated += run.count
                    if run.kind is DATA and run.host_offset is not None:
                        h = run.host_offset
                        for i in range(run.start, run.start + run.count):
                            host[i] = h
                            h += BLOCK_SIZE
                    else:
                        for i in range(run.start, run.start + run.count):
                            host[i] = -1
        except (OSError, HashcacheError) as exc:
            raise SpecError(f"layer {layer.id[:12]}: cannot read {path}: {exc}") from exc
        if allocated != len(layer.manifest):
            raise SpecError(f"layer {layer.id[:12]}: {path} allocates {allocated} blocks but its manifest lists "
                            f"{len(layer.manifest)}; the file and the manifest do not belong together")
        return host

    def _resolve(self) -> None:
        """Owner of every block (topmost layer listing it; -1 for zeros) and the segment map."""
        nb = self.nblocks
        owner = array("h", [-1]) * nb
        host = array("q", [0]) * nb if any(layer.local for layer in self.layers) else None
        for layer in self.layers:
            keys = _record_keys(layer.manifest)
            pos = layer.pos
            if layer.local:
                assert host is not None
                lh = self._local_offsets(layer)
                for k in keys:
                    i = k >> 1
                    if i >= nb:
                        break
                    if k & 1:
                        owner[i] = -1
                    else:
                        h = lh[i]
                        if h < 0:
                            raise SpecError(f"layer {layer.id[:12]}: its manifest lists block {i} as data but "
                                            f"{layer.spec.local_path} does not store it")
                        owner[i] = pos
                        host[i] = h
            else:
                for k in keys:
                    i = k >> 1
                    if i >= nb:
                        break
                    owner[i] = -1 if k & 1 else pos
        local = [layer.local for layer in self.layers]
        seg_start, seg_owner, seg_host = array("q"), array("h"), array("q")
        prev = -2
        expect = 0
        for i, o in enumerate(owner):
            if o != prev:
                seg_start.append(i)
                seg_owner.append(o)
                if o >= 0 and local[o]:
                    assert host is not None
                    expect = host[i]
                    seg_host.append(expect)
                else:
                    seg_host.append(0)
                prev = o
            elif o >= 0 and local[o]:
                assert host is not None
                if host[i] != expect:
                    expect = host[i]
                    seg_start.append(i)
                    seg_owner.append(o)
                    seg_host.append(expect)
            expect += BLOCK_SIZE
        self._owner = owner
        self._seg_start = seg_start
        self._seg_owner = seg_owner
        self._seg_host = seg_host

    def _refresh_presence(self, layer: _Layer, indices: Iterable[int]) -> int:
        """Pick up blocks the shadow has (set by us earlier or by another process); returns how many."""
        assert layer.shadow is not None
        found = [i for i in indices if not layer.has(i) and layer.shadow.has(i)]
        if found:
            with self._lock:
                self._set_present(layer, found)
        return len(found)

    def _set_present(self, layer: _Layer, indices: Iterable[int]) -> None:
        """Mark blocks present in this process's view. Caller holds self._lock."""
        p = layer.present
        n = 0
        for i in indices:
            bit = 1 << (i & 7)
            if not p[i >> 3] & bit:
                p[i >> 3] |= bit
                n += 1
        layer.present_count += n

    def _fill(self, first: int, end: int, view: memoryview, window: int) -> None:
        seg_start = self._seg_start
        seg_owner = self._seg_owner
        nseg = len(seg_start)
        i = bisect_right(seg_start, first) - 1
        b = first
        zero = local = 0
        remote: list[tuple[_Layer, int, int, memoryview]] = []
        while b < end:
            nxt = seg_start[i + 1] if i + 1 < nseg else self.nblocks
            e = nxt if nxt < end else end
            o = seg_owner[i]
            v = view[(b - first) << _SHIFT:(e - first) << _SHIFT]
            if o < 0:
                _zero(v)
                zero += e - b
            else:
                layer = self.layers[o]
                if layer.local:
                    self._read_local(layer, self._seg_host[i] + ((b - seg_start[i]) << _SHIFT), b, e, v)
                    local += e - b
                else:
                    remote.append((layer, b, e, v))
            b = e
            i += 1
        if remote:
            self._read_remote(remote, end, window)
        if zero or local:
            self._count(zero_blocks=zero, local_blocks=local)

    def _read_local(self, layer: _Layer, host: int, b: int, e: int, v: memoryview) -> None:
        valid = min(len(v), self.size - (b << _SHIFT))  # the disk's last block may be short
        try:
            _preadv_full(layer.fd, v[:valid], host, f"layer {layer.id[:12]} ({layer.spec.local_path})")
        except OSError as exc:
            raise DiskServerError(f"layer {layer.id[:12]}: reading blocks {b}..{e - 1} from "
                                  f"{layer.spec.local_path} failed: {exc.strerror or exc}") from exc
        if valid < len(v):
            _zero(v[valid:])

    def _read_remote(self, pieces: list[tuple[_Layer, int, int, memoryview]], end: int, window: int) -> None:
        misses: dict[int, list[int]] = {}
        got: dict[int, dict[int, bytes]] = {}
        for layer, b, e, _v in pieces:
            if not layer.all_present(b, e):
                absent = [j for j in range(b, e) if not layer.has(j)]
                self._refresh_presence(layer, absent)
                absent = [j for j in absent if not layer.has(j)]
                if absent and layer.pending:
                    # fetched but not yet persisted: a hit served from memory, not a miss (a miss would
                    # also wait for a read-ahead request of its own)
                    with self._lock:
                        pending = layer.pending
                        held = {j: pending[j] for j in absent if j in pending}
                    if held:
                        got.setdefault(layer.pos, {}).update(held)
                        absent = [j for j in absent if j not in held]
                if absent:
                    misses.setdefault(layer.pos, []).extend(absent)
        if misses:
            t0 = time.monotonic_ns()
            with self._lock:
                self._fg_busy += 1
            try:
                for pos, want in misses.items():
                    layer = self.layers[pos]
                    extra = self._readahead(layer, end, window) if window else []
                    got.setdefault(pos, {}).update(self._obtain(layer, want, extra, prefetch=False, need_data=True))
            finally:
                with self._lock:
                    self._fg_busy -= 1
                    self._fg_last = time.monotonic()
            nmiss = sum(len(w) for w in misses.values())
            self._count(miss_blocks=nmiss, miss_ns=time.monotonic_ns() - t0)
        shadow = memory = 0
        for layer, b, e, v in pieces:
            mem = got.get(layer.pos)
            if not mem:
                self._read_shadow(layer, b, e, v)
                shadow += e - b
                continue
            j = b
            while j < e:
                d = mem.get(j)
                if d is not None:
                    o = (j - b) << _SHIFT
                    v[o:o + BLOCK_SIZE] = d
                    memory += 1
                    j += 1
                    continue
                k = j + 1
                while k < e and k not in mem:
                    k += 1
                self._read_shadow(layer, j, k, v[(j - b) << _SHIFT:(k - b) << _SHIFT])
                shadow += k - j
                j = k
        self._count(shadow_blocks=shadow, memory_blocks=memory)

    def _read_shadow(self, layer: _Layer, b: int, e: int, v: memoryview) -> None:
        try:
            _preadv_full(layer.fd, v, b << _SHIFT, f"shadow of layer {layer.id[:12]}")
        except OSError as exc:
            raise DiskServerError(f"layer {layer.id[:12]}: reading blocks {b}..{e - 1} from its shadow failed: "
                                  f"{exc.strerror or exc}") from exc

    def segments(self, offset: int, length: int) -> Iterator[tuple[int, int, int]]:
        """``(start_block, end_block, owner)`` runs covering the byte range (owner -1: zeros)."""
        if length <= 0:
            return
        first = offset >> _SHIFT
        end = min((offset + length + _MASK) >> _SHIFT, self.nblocks)
        seg_start = self._seg_start
        i = bisect_right(seg_start, first) - 1
        b = first
        while b < end:
            nxt = seg_start[i + 1] if i + 1 < len(seg_start) else self.nblocks
            e = min(nxt, end)
            yield b, e, self._seg_owner[i]
            b = e
            i += 1

    def extents(self, offset: int, length: int) -> list[tuple[int, int, bool]]:
        """``(offset, length, is_zero)`` extents covering ``[offset, offset+length)``, merged."""
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"extents of {length} bytes at {offset} are outside the disk ({self.size} bytes)")
        out: list[tuple[int, int, bool]] = []
        stop = offset + length
        for b, e, o in self.segments(offset, length):
            s = max(b << _SHIFT, offset)
            t = min(e << _SHIFT, stop)
            z = o < 0
            if out and out[-1][2] == z:
                out[-1] = (out[-1][0], t - out[-1][0], z)
            else:
                out.append((s, t - s, z))
        return out

    def cache(self, offset: int, length: int) -> None:
        """Make the byte range local (fetch what is missing), without returning data."""
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"cache of {length} bytes at {offset} is outside the disk ({self.size} bytes)")
        misses: dict[int, list[int]] = {}
        for b, e, o in self.segments(offset, length):
            if o >= 0 and not self.layers[o].local:
                layer = self.layers[o]
                if not layer.all_present(b, e):
                    absent = [j for j in range(b, e) if not layer.has(j)]
                    self._refresh_presence(layer, absent)
                    misses.setdefault(o, []).extend(j for j in absent if not layer.has(j))
        for pos, want in misses.items():
            for k in range(0, len(want), MAX_BATCH):
                self._obtain(self.layers[pos], want[k:k + MAX_BATCH], [], prefetch=False, need_data=False)
