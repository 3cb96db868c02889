"""The flattened view of a layer chain, served block by block (demand paging, §4.3 of the Collective paper).

A :class:`ChainSpec` names the layers of one disk, bottom (root) to top, each either *local* (a qcow2
file on this host) or *remote* (on a source host, reached by HCP), with every layer's manifest as a
local file. A :class:`Chain` resolves, once at open, every 4 KiB guest block to the topmost layer
that owns it and serves reads of the flattened disk:

* a block no layer owns, or that its owner flags as zero: zeros, no I/O;
* a block of a local layer: read from its qcow2 file;
* a block of a remote layer: from the layer's *shadow* (``<shadow_dir>/<layer-id>.data`` and
  ``.bitmap``: a sparse file plus a persistent presence bitmap, shared by every chain using the
  layer — layers are immutable — and surviving restarts); else from the host's hash cache (the
  cache verifies the data); else fetched from the source host with HCP READ, in one batch with the
  request's other missing blocks and a read-ahead window that grows while reads are sequential.
  Every fetched block is checked against its manifest hash; a wrong block is an error naming the
  layer and block, and is neither served nor stored.

Fetched blocks are served at once from memory and made durable behind the reader's back
(*write-behind*): a persister thread writes them to the shadow, fdatasyncs once per group and only
then sets their presence bits (``Shadow.store``), then records them in the hash cache. Until then
they are served from memory. An fdatasync costs ~0.3 ms here — more than the rest of a miss on
loopback — so it stays off the read path; a crash loses at most the blocks not yet persisted (they
are fetched again), never marks a block present that is not on disk. ``write_behind=False`` stores
synchronously instead.

Thread-safe: reads may come from many threads at once (nbdkit's parallel thread model). Reads of
present blocks take no lock; misses claim their blocks, so two threads never fetch a block twice
(except that a foreground read never waits for a background prefetch batch: it fetches the block
itself).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from diskserver.errors import BlockMismatch, DiskServerError, SourceError, SpecError
from diskserver.source import HcpSource
from hashcache.atomic import write_atomic
from hashcache.blocks import BLOCK_SIZE
from hashcache.cache import HashCache
from hashcache.errors import HashcacheError
from hashcache.hcp import MAX_BATCH
from hashcache.manifest import KIND_LAYER, RECORD_SIZE, Manifest
from hashcache.qcow2 import DATA, Qcow2Image
from hashcache.shadow import Shadow

log = logging.getLogger("diskserver")

SPEC_VERSION = 1
_SHIFT = 12
assert 1 << _SHIFT == BLOCK_SIZE
_MASK = BLOCK_SIZE - 1
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")  # ASCII only: \w would take any script's letters
_ZEROS = memoryview(bytes(4 << 20))
_FF = b"\xff" * 4096

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``."""


# -- the spec ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteSpec:
    """Where a remote layer comes from: an agent URL and a file holding its bearer token."""

    url: str
    token_file: str


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its id (manifest digest), its manifest file, and either a local qcow2 or a remote source."""

    id: str
    manifest_path: str
    local_path: str | None = None
    remote: RemoteSpec | None = None

    @property
    def is_local(self) -> bool:
        return self.local_path is not None


@dataclass(frozen=True)
class ReadaheadSpec:
    """Read-ahead on misses: 0 blocks for random reads; on sequential reads it starts at ``min_blocks``
    and doubles per sequential request up to ``max_blocks``."""

    min_blocks: int = 4
    max_blocks: int = 256


@dataclass(frozen=True)
class RetrySpec:
    """How long a fetch keeps retrying an unreachable or failing source before the read fails (EIO)."""

    seconds: float = 10.0
    initial_delay: float = 0.05
    max_delay: float = 1.0
    request_timeout: float = 30.0


@dataclass(frozen=True)
class ChainSpec:
    """Everything a disk server needs to serve one flattened chain; JSON-serialisable.

    Paths in a spec file may be relative: they are taken relative to the file's directory.
    """

    layers: tuple[LayerSpec, ...]
    shadow_dir: str
    size: int | None = None  # virtual size; default (and must equal) the top layer's
    hash_cache: str | None = None
    readahead: ReadaheadSpec = field(default_factory=ReadaheadSpec)
    retry: RetrySpec = field(default_factory=RetrySpec)
    compress: bool = True  # zstd on the wire
    compress_level: int = 1
    write_behind: bool = True
    max_pending_blocks: int = 16384  # fetched blocks held in memory until persisted (64 MiB)
    prefetch: bool = False  # a server started from this spec pulls every remaining block in the background
    prefetch_batch_blocks: int = 256
    stats_path: str | None = None  # default <shadow_dir>/<name>.stats.json
    stats_interval: float = 1.0
    name: str | None = None  # default "chain-" + the top layer id's first 16 hex digits

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        self.validate()

    # -- checks ------------------------------------------------------------------------------------

    def validate(self) -> None:
        if not self.layers:
            raise SpecError("a chain needs at least one layer")
        seen: set[str] = set()
        for n, layer in enumerate(self.layers):
            where = f"layer {n}"
            if not isinstance(layer, LayerSpec):
                raise SpecError(f"{where}: not a LayerSpec")
            if not isinstance(layer.id, str) or not _HEX64.fullmatch(layer.id):
                raise SpecError(f"{where}: id {layer.id!r} is not a 64-hex-digit layer digest")
            if layer.id in seen:
                raise SpecError(f"layer {layer.id[:12]} appears twice in the chain")
            seen.add(layer.id)
            where = f"layer {layer.id[:12]}"
            if not isinstance(layer.manifest_path, str) or not layer.manifest_path:
                raise SpecError(f"{where}: manifest_path is required")
            if (layer.local_path is None) == (layer.remote is None):
                raise SpecError(f"{where}: give exactly one of local_path and remote")
            if layer.local_path is not None and (not isinstance(layer.local_path, str) or not layer.local_path):
                raise SpecError(f"{where}: local_path must be a path")
            if layer.remote is not None:
                r = layer.remote
                if not isinstance(r, RemoteSpec):
                    raise SpecError(f"{where}: remote must be a RemoteSpec")
                if not isinstance(r.url, str) or not r.url.startswith(("http://", "https://")):
                    raise SpecError(f"{where}: remote url {r.url!r} must start with http:// or https://")
                if not isinstance(r.token_file, str) or not r.token_file:
                    raise SpecError(f"{where}: remote token_file is required")
        if not isinstance(self.shadow_dir, str) or not self.shadow_dir:
            raise SpecError("shadow_dir is required")
        if self.size is not None and (type(self.size) is not int or self.size <= 0):
            raise SpecError(f"size {self.size!r} must be a positive integer")
        if self.hash_cache is not None and (not isinstance(self.hash_cache, str) or not self.hash_cache):
            raise SpecError("hash_cache must be a path or null")
        ra = self.readahead
        if not (type(ra.min_blocks) is int and type(ra.max_blocks) is int and 0 <= ra.min_blocks <= ra.max_blocks):
            raise SpecError("readahead: need 0 <= min_blocks <= max_blocks (integers)")
        if ra.max_blocks > 8 * MAX_BATCH:
            raise SpecError(f"readahead: max_blocks is at most {8 * MAX_BATCH}")
        rt = self.retry
        for key in ("seconds", "initial_delay", "max_delay", "request_timeout"):
            v = getattr(rt, key)
            if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                raise SpecError(f"retry.{key} must be a non-negative number")
        if rt.request_timeout <= 0:
            raise SpecError("retry.request_timeout must be positive")
        if not isinstance(self.compress, bool) or not isinstance(self.write_behind, bool):
            raise SpecError("compress and write_behind must be true or false")
        if not isinstance(self.prefetch, bool):
            raise SpecError("prefetch must be true or false")
        if type(self.compress_level) is not int or not 1 <= self.compress_level <= 19:
            raise SpecError("compress_level must be 1..19")
        if type(self.prefetch_batch_blocks) is not int or not 1 <= self.prefetch_batch_blocks <= MAX_BATCH:
            raise SpecError(f"prefetch_batch_blocks must be 1..{MAX_BATCH}")
        if type(self.max_pending_blocks) is not int or self.max_pending_blocks < 1:
            raise SpecError("max_pending_blocks must be a positive integer")
        if not isinstance(self.stats_interval, int | float) or self.stats_interval <= 0:
            raise SpecError("stats_interval must be a positive number")
        if self.name is not None and (not isinstance(self.name, str) or not _NAME.fullmatch(self.name)):
            raise SpecError(f"name {self.name!r} must be 1-100 ASCII letters, digits, '.', '_' or '-', "
                            "starting with a letter, digit or '_'")

    # -- derived -----------------------------------------------------------------------------------

    @property
    def chain_name(self) -> str:
        return self.name or f"chain-{self.layers[-1].id[:16]}"

    @property
    def resolved_stats_path(self) -> Path:
        if self.stats_path:
            return Path(self.stats_path)
        return Path(self.shadow_dir) / f"{self.chain_name}.stats.json"

    @property
    def remote_layers(self) -> list[LayerSpec]:
        return [layer for layer in self.layers if layer.remote is not None]

    # -- (de)serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        layers = []
        for layer in self.layers:
            layers.append({
                "id": layer.id,
                "manifest_path": layer.manifest_path,
                "local_path": layer.local_path,
                "remote": None if layer.remote is None else {"url": layer.remote.url,
                                                             "token_file": layer.remote.token_file},
            })
        return {
            "version": SPEC_VERSION,
            "size": self.size,
            "layers": layers,
            "shadow_dir": self.shadow_dir,
            "hash_cache": self.hash_cache,
            "readahead": {"min_blocks": self.readahead.min_blocks, "max_blocks": self.readahead.max_blocks},
            "retry": {"seconds": self.retry.seconds, "initial_delay": self.retry.initial_delay,
                      "max_delay": self.retry.max_delay, "request_timeout": self.retry.request_timeout},
            "compress": self.compress,
            "compress_level": self.compress_level,
            "write_behind": self.write_behind,
            "max_pending_blocks": self.max_pending_blocks,
            "prefetch": self.prefetch,
            "prefetch_batch_blocks": self.prefetch_batch_blocks,
            "stats_path": self.stats_path,
            "stats_interval": self.stats_interval,
            "name": self.name,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any, base_dir: str | os.PathLike[str] | None = None) -> ChainSpec:
        """Build and validate a spec; relative paths are resolved against ``base_dir`` (if given)."""
        if not isinstance(data, dict):
            raise SpecError("a chain spec is a JSON object")
        known = {"version", "size", "layers", "shadow_dir", "hash_cache", "readahead", "retry", "compress",
                 "compress_level", "write_behind", "max_pending_blocks", "prefetch", "prefetch_batch_blocks",
                 "stats_path", "stats_interval", "name"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"unknown chain spec field(s): {', '.join(unknown)}")
        if data.get("version", SPEC_VERSION) != SPEC_VERSION:
            raise SpecError(f"chain spec version {data.get('version')!r} is not supported (expected {SPEC_VERSION})")

        def path(value: Any, what: str) -> str | None:
            if value is None:
                return None
            if not isinstance(value, str) or not value:
                raise SpecError(f"{what} must be a path")
            if base_dir is not None and not os.path.isabs(value):
                return os.path.join(os.fspath(base_dir), value)
            return value

        raw_layers = data.get("layers")
        if not isinstance(raw_layers, list):
            raise SpecError("layers must be a list (bottom to top)")
        layers = []
        for n, item in enumerate(raw_layers):
            if not isinstance(item, dict):
                raise SpecError(f"layer {n} must be an object")
            extra = sorted(set(item) - {"id", "manifest_path", "local_path", "remote"})
            if extra:
                raise SpecError(f"layer {n}: unknown field(s): {', '.join(extra)}")
            remote = item.get("remote")
            if remote is not None:
                if not isinstance(remote, dict) or set(remote) - {"url", "token_file"}:
                    raise SpecError(f"layer {n}: remote must be {{\"url\": ..., \"token_file\": ...}}")
                remote = RemoteSpec(url=remote.get("url"), token_file=path(remote.get("token_file"),
                                                                            f"layer {n} remote token_file"))
            layers.append(LayerSpec(id=item.get("id"), manifest_path=path(item.get("manifest_path"),
                                                                          f"layer {n} manifest_path"),
                                    local_path=path(item.get("local_path"), f"layer {n} local_path"),
                                    remote=remote))

        def sub(key: str, cls_: type, fields: tuple[str, ...]) -> Any:
            value = data.get(key)
            if value is None:
                return cls_()
            if not isinstance(value, dict) or set(value) - set(fields):
                raise SpecError(f"{key} must be an object with fields {', '.join(fields)}")
            return cls_(**value)

        kwargs: dict[str, Any] = {
            "layers": tuple(layers),
            "shadow_dir": path(data.get("shadow_dir"), "shadow_dir"),
            "hash_cache": path(data.get("hash_cache"), "hash_cache"),
            "stats_path": path(data.get("stats_path"), "stats_path"),
            "readahead": sub("readahead", ReadaheadSpec, ("min_blocks", "max_blocks")),
            "retry": sub("retry", RetrySpec, ("seconds", "initial_delay", "max_delay", "request_timeout")),
        }
        for key in ("size", "compress", "compress_level", "write_behind", "max_pending_blocks", "prefetch",
                    "prefetch_batch_blocks", "stats_interval", "name"):
            if key in data and data[key] is not None:
                kwargs[key] = data[key]
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ChainSpec:
        path = os.path.abspath(os.fspath(path))
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read())
        except OSError as exc:
            raise SpecError(f"chain spec {path}: cannot read: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise SpecError(f"chain spec {path}: not valid JSON ({exc})") from exc
        try:
            return cls.from_dict(data, base_dir=os.path.dirname(path))
        except SpecError as exc:
            raise SpecError(f"chain spec {path}: {exc}") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file, fsync, rename)."""
        write_atomic(Path(path), self.to_json().encode() + b"\n", durable=True)


# -- the chain ---------------------------------------------------------------------------------------


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
        self.source: HcpSource | None = None
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


class Chain:
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
        self._sources: dict[tuple[str, str], HcpSource] = {}
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
        self._stats_written = -1
        self._fg_busy = 0
        self._fg_last = 0.0
        self._ra_ends: deque[int] = deque(maxlen=8)
        self._ra_window = 0
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

    # -- opening -----------------------------------------------------------------------------------

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
                key = (ls.remote.url, ls.remote.token_file)
                source = self._sources.get(key)
                if source is None:
                    rt = spec.retry
                    try:
                        source = HcpSource(ls.remote.url, ls.remote.token_file, retry_seconds=rt.seconds,
                                           initial_delay=rt.initial_delay, max_delay=rt.max_delay,
                                           request_timeout=rt.request_timeout, compress=spec.compress,
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

    # -- lifecycle ---------------------------------------------------------------------------------

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

    # -- counters ----------------------------------------------------------------------------------

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
        version = self._stats_version
        write_atomic(path, json.dumps(self.stats(), sort_keys=True).encode() + b"\n", durable=False)
        self._stats_written = version
        return path

    def _stats_writer(self) -> None:
        while not self._stopping.wait(self.spec.stats_interval):
            if self._stats_version != self._stats_written:
                try:
                    self.write_stats()
                except OSError as exc:
                    log.warning("cannot write the stats file %s: %s", self.spec.resolved_stats_path, exc)

    # -- reading -----------------------------------------------------------------------------------

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

    def _note_request(self, first: int, end: int) -> int:
        """Read-ahead window (blocks) for this request.

        A request is sequential when it starts exactly where one of the last few requests ended (a
        few, because a client with several requests in flight reorders them). The window is 0 for
        random reads; it starts at ``min_blocks`` on the first sequential request and doubles per
        sequential request up to ``max_blocks``. Lock-free: a race only perturbs the heuristic."""
        ra = self.spec.readahead
        ends = self._ra_ends
        if ra.max_blocks and first in ends:
            window = min(ra.max_blocks, max(ra.min_blocks, self._ra_window * 2, 1))
        else:
            window = 0
        self._ra_window = window
        ends.append(end)
        return window

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

    def _readahead(self, layer: _Layer, end: int, window: int) -> list[int]:
        """Blocks after the request owned by ``layer`` and not yet local, within ``window`` blocks."""
        owner = self._owner
        pos = layer.pos
        stop = min(end + window, self.nblocks)
        pending = layer.pending
        return [j for j in range(end, stop) if owner[j] == pos and not layer.has(j) and j not in pending]

    # -- obtaining missing blocks ------------------------------------------------------------------

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

    # -- extents and cache requests ----------------------------------------------------------------

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

    # -- prefetch ----------------------------------------------------------------------------------

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
