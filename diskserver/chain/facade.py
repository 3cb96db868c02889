"""The :class:`Chain` facade: opening a spec's layers, threads, statistics and ``read``; resolution,
fetching and persisting are its parts (one object, one lock)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from diskserver.chain.fastmap import FastMap
from diskserver.chain.fetch import Fetching
from diskserver.chain.layers import (
    _COUNTERS,
    _MASK,
    _SHIFT,
    _Flight,
    _Layer,
    log,
)
from diskserver.chain.persist import Persisting
from diskserver.chain.resolve import BlockResolution
from diskserver.chain.spec import ChainSpec
from diskserver.errors import DiskServerError, SourceError, SpecError
from diskserver.source import BlockSource, open_source
from hashcache.atomic import write_atomic
from hashcache.blocks import BLOCK_SIZE
from hashcache.cache import HashCache
from hashcache.errors import HashcacheError
from hashcache.manifest import KIND_LAYER, Manifest
from hashcache.shadow import Shadow


class Chain(BlockResolution, Fetching, Persisting):
    """An open chain. ``Chain.open(spec)``; ``read``/``read_into``; ``close()`` (or use ``with``)."""

    @classmethod
    def open(cls, spec: ChainSpec | str | os.PathLike[str], *, background: bool = True) -> Chain:
        """Open a chain from a spec or a spec file. ``background=False`` starts no threads: fetched
        blocks are then stored synchronously and stats are written only by :meth:`write_stats`/close."""
        if not isinstance(spec, ChainSpec):
            spec = ChainSpec.load(spec)
        return cls(spec, background=background)

    def __init__(self, spec: ChainSpec, *, background: bool = True) -> None:
        self.spec = spec
        self.layers: list[_Layer] = []
        self._cache: HashCache | None = None
        self._sources: dict[tuple[str, str, str | None, str | None], BlockSource] = {}
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._inflight: dict[tuple[int, int], _Flight] = {}
        self._queue: list[tuple[_Layer, dict[int, bytes], list[int]]] = []
        self._pending_total = 0
        self._persisting = 0
        self._closed = False
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stats_lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._stats_version = 0
        self._stats_written: tuple[int, int] | None = None
        self._fg_busy = 0
        self._fg_last = 0.0
        self._ra_ends: deque[int] = deque(maxlen=8)
        self._ra_window = 0
        self._fastmap: FastMap | None = None  # the native read path's map, once attach_fastmap wrote it
        self._flushing = 0  # threads waiting in flush()
        self._last_error: str | None = None
        self._opened_at = time.time()
        self.write_behind = spec.write_behind and background
        try:
            self._open_layers()
            self._resolve()
            if spec.hash_cache:
                try:
                    self._cache = HashCache.open(spec.hash_cache)
                except HashcacheError as exc:
                    raise SpecError(f"hash cache {spec.hash_cache}: {exc}") from exc
            if background:
                self._start_threads()
        except BaseException:
            self._release()
            raise

    def _open_layers(self) -> None:
        spec = self.spec
        parent: str | None = None
        for pos, ls in enumerate(spec.layers):
            try:
                m = Manifest.read(ls.manifest_path)
            except HashcacheError as exc:
                raise SpecError(f"layer {ls.id[:12]}: {exc}") from exc
            if m.digest != ls.id:
                raise SpecError(f"layer {ls.id[:12]}: manifest {ls.manifest_path} is that of layer {m.digest[:12]}")
            if m.kind != KIND_LAYER or m.block_size != BLOCK_SIZE:
                raise SpecError(f"layer {ls.id[:12]}: manifest {ls.manifest_path} is not a 4 KiB layer manifest")
            if m.parent != parent:
                want = "no parent (a root layer)" if parent is None else f"parent {parent[:12]}"
                got = "none" if m.parent is None else m.parent[:12]
                raise SpecError(f"layer {ls.id[:12]}: its manifest names parent {got}, but the chain gives it {want}")
            parent = ls.id
            layer = _Layer(pos, ls, m)
            self.layers.append(layer)
            if layer.local:
                assert ls.local_path is not None
                try:
                    layer.fd = os.open(ls.local_path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as exc:
                    raise SpecError(f"layer {ls.id[:12]}: cannot open {ls.local_path}: {exc.strerror}") from exc
            else:
                assert ls.remote is not None
                try:
                    layer.shadow = Shadow(Path(spec.shadow_dir) / ls.id, layer.nblocks)
                    layer.fd = os.open(layer.shadow.data_path, os.O_RDONLY | os.O_CLOEXEC)
                except (OSError, HashcacheError) as exc:
                    raise SpecError(f"layer {ls.id[:12]}: cannot open its shadow in {spec.shadow_dir}: {exc}") from exc
                layer.present = bytearray((layer.nblocks + 7) // 8)
                self._refresh_presence(layer, layer.data_blocks)
                key = (ls.remote.url, ls.remote.token_file, ls.remote.fingerprint, ls.remote.opener)
                source = self._sources.get(key)
                if source is None:
                    try:
                        source = open_source(ls.remote, spec.retry, compress=spec.compress,
                                             level=spec.compress_level)
                    except SourceError as exc:
                        raise SpecError(f"layer {ls.id[:12]}: {exc}") from exc
                    self._sources[key] = source
                layer.source = source
        top = self.layers[-1].manifest
        if spec.size is not None and spec.size != top.size:
            raise SpecError(f"the chain's size {spec.size} differs from its top layer's ({top.size})")
        self.size: int = top.size
        self.nblocks: int = -(-self.size // BLOCK_SIZE)

    def attach_fastmap(self, path: str | os.PathLike[str]) -> None:
        """Write the map the native read path (diskserver/fastread/) serves hits from; from then on its
        hits count in :meth:`stats` and advance the read-ahead state this chain keeps."""
        self._fastmap = FastMap.write(path, self)

    def _start_threads(self) -> None:
        if self.write_behind:
            t = threading.Thread(target=self._persister, name="diskserver-persist", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._stats_writer, name="diskserver-stats", daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        """Persist what was fetched, write the stats file, release everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._stopping.set()
            with self._cv:
                self._cv.notify_all()
            for t in self._threads:
                t.join(30)
            with contextlib.suppress(OSError):
                self.write_stats()
            self._release()

    def _release(self) -> None:
        if self._fastmap is not None:
            self._fastmap.close()
            self._fastmap = None
        for layer in self.layers:
            if layer.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(layer.fd)
                layer.fd = -1
            if layer.shadow is not None:
                with contextlib.suppress(Exception):
                    layer.shadow.close()
        for source in self._sources.values():
            with contextlib.suppress(Exception):
                source.close()
        if self._cache is not None:
            with contextlib.suppress(Exception):
                self._cache.close()
            self._cache = None

    def __enter__(self) -> Chain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, **kw: int) -> None:
        with self._stats_lock:
            c = self._counters
            for k, v in kw.items():
                c[k] += v
            self._stats_version += 1

    def stats(self) -> dict[str, Any]:
        """Counters (see ``_COUNTERS``), plus per-layer presence and derived figures."""
        with self._stats_lock:
            out: dict[str, Any] = dict(self._counters)
        if self._fastmap is not None:  # reads the native path served: counted there, added here
            fast = self._fastmap.counters()
            for key in ("requests", "guest_bytes", "zero_blocks", "local_blocks", "shadow_blocks"):
                out[key] += fast[key]
            out["native_reads"] = fast["requests"]
            out["native_passed"] = fast["passed"]
        out["read_amplification"] = round(out["source_bytes"] / out["guest_bytes"], 4) if out["guest_bytes"] else 0.0
        out["miss_seconds"] = out.pop("miss_ns") / 1e9
        layers = []
        remaining = 0
        for layer in self.layers:
            entry: dict[str, Any] = {"id": layer.id, "local": layer.local, "data_blocks": len(layer.data_blocks)}
            if not layer.local:
                entry["present_blocks"] = layer.present_count
                entry["pending_blocks"] = len(layer.pending)
                remaining += (len(layer.data_blocks) - layer.present_count) * BLOCK_SIZE
            layers.append(entry)
        out["layers"] = layers
        out["remaining_bytes"] = remaining
        out["complete"] = remaining == 0
        out["pending_blocks"] = self._pending_total
        out["size"] = self.size
        out["name"] = self.spec.chain_name
        out["pid"] = os.getpid()
        out["opened_at"] = self._opened_at
        out["updated_at"] = time.time()
        out["last_error"] = self._last_error
        return out

    def write_stats(self) -> Path:
        """Write the stats JSON file now (atomically); returns its path."""
        path = self.spec.resolved_stats_path
        version = self._stats_mark()
        write_atomic(path, json.dumps(self.stats(), sort_keys=True).encode() + b"\n", durable=False)
        self._stats_written = version
        return path

    def _stats_mark(self) -> tuple[int, int]:
        """Changes when any counter does: this process's, or the native read path's."""
        return self._stats_version, self._fastmap.counters()["requests"] if self._fastmap is not None else 0

    def _stats_writer(self) -> None:
        while not self._stopping.wait(self.spec.stats_interval):
            if self._stats_mark() != self._stats_written:
                try:
                    self.write_stats()
                except OSError as exc:
                    log.warning("cannot write the stats file %s: %s", self.spec.resolved_stats_path, exc)

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes of the flattened disk at ``offset`` (any alignment)."""
        buf = bytearray(length)
        self.read_into(offset, buf)
        return bytes(buf)

    def read_into(self, offset: int, buf: Any) -> None:
        """Fill the writable buffer ``buf`` with the disk's bytes at ``offset``."""
        view = memoryview(buf).cast("B")
        n = len(view)
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"read of {n} bytes at offset {offset} is outside the disk ({self.size} bytes)")
        if self._closed:
            raise DiskServerError("the chain is closed")
        if n == 0:
            return
        first = offset >> _SHIFT
        end = (offset + n + _MASK) >> _SHIFT
        window = self._note_request(first, end)
        try:
            if offset & _MASK or n & _MASK:
                tmp = bytearray((end - first) << _SHIFT)
                self._fill(first, end, memoryview(tmp), window)
                skip = offset - (first << _SHIFT)
                view[:] = memoryview(tmp)[skip:skip + n]
            else:
                self._fill(first, end, view, window)
        except Exception as exc:
            self._count(requests=1, guest_bytes=n, read_errors=1)
            self._last_error = str(exc)
            raise
        self._count(requests=1, guest_bytes=n)
