"""The chain spec: the layers of one disk (local qcow2 files or remote sources, each with its
manifest), where shadows and the hash cache live, read-ahead, retry and write-behind settings.
JSON-serialisable, validated on construction; bad specs are refused with a SpecError that
names the field."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from diskserver.errors import SpecError
from hashcache import wirejson
from hashcache.atomic import write_atomic
from hashcache.errors import Error
from hashcache.hcp import MAX_BATCH
from hashcache.transport.tls import parse_fingerprint

SPEC_VERSION = 1
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")  # ASCII only: \w would take any script's letters
_OPENER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class RemoteSpec:
    """Where a remote layer comes from: an agent URL, a file holding its bearer token, and over https the
    fingerprint its certificate is pinned to (None: CA validation).

    ``opener`` (``"package.module:function"``) names another kind of source, one that is no agent (a store of
    blocks the composing program knows, e.g. an object store): the disk server imports it and calls
    ``function(url, token_file, retry)`` for a :class:`diskserver.source.BlockSource`; ``url`` is then that
    source's address, in whatever scheme it reads, and ``token_file`` its secret (what is in it is the
    opener's business)."""

    url: str
    token_file: str
    fingerprint: str | None = None
    opener: str | None = None


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

    def window(self, sequential: bool, previous: int) -> int:
        """The window of a request, given whether it is sequential and the last request's window (the
        native read path's filter keeps a copy of this rule: ``diskserver/fastread/fastread.c``)."""
        if not (sequential and self.max_blocks):
            return 0
        return min(self.max_blocks, max(self.min_blocks, previous * 2, 1))


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
                if r.opener is not None:
                    if not isinstance(r.opener, str) or not _OPENER.fullmatch(r.opener):
                        raise SpecError(f"{where}: remote opener {r.opener!r:.80} must be 'package.module:function'")
                    if r.fingerprint is not None:
                        raise SpecError(f"{where}: a fingerprint pins an agent's certificate; a source with an "
                                        "opener takes none")
                    if not isinstance(r.url, str) or not r.url:
                        raise SpecError(f"{where}: remote url is required")
                elif not isinstance(r.url, str) or not r.url.startswith(("http://", "https://")):
                    raise SpecError(f"{where}: remote url {r.url!r} must start with http:// or https://")
                if not isinstance(r.token_file, str) or not r.token_file:
                    raise SpecError(f"{where}: remote token_file is required")
                if r.fingerprint is not None:
                    try:
                        parse_fingerprint(r.fingerprint)
                    except Error as exc:
                        raise SpecError(f"{where}: remote {exc}") from None
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
            if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v < math.inf:
                raise SpecError(f"retry.{key} must be a non-negative finite number, not {v!r:.40}")
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
                "remote": None if layer.remote is None else _remote_dict(layer.remote),
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
                if not isinstance(remote, dict) or set(remote) - {"url", "token_file", "fingerprint", "opener"}:
                    raise SpecError(f"layer {n}: remote must be {{\"url\": ..., \"token_file\": ..., "
                                    "\"fingerprint\": ..., \"opener\": ...}}")
                pin = remote.get("fingerprint")
                if pin is not None and not isinstance(pin, str):
                    raise SpecError(f"layer {n}: remote fingerprint must be a string")
                # a missing url, token_file, id or manifest_path goes in as None: validate() names it
                remote = RemoteSpec(url=cast(str, remote.get("url")),
                                    token_file=cast(str, path(remote.get("token_file"),
                                                              f"layer {n} remote token_file")),
                                    fingerprint=pin, opener=remote.get("opener"))
            layers.append(LayerSpec(id=cast(str, item.get("id")),
                                    manifest_path=cast(str, path(item.get("manifest_path"),
                                                                 f"layer {n} manifest_path")),
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
                data = wirejson.loads(f.read())
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



def _remote_dict(remote: RemoteSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"url": remote.url, "token_file": remote.token_file, "fingerprint": remote.fingerprint}
    if remote.opener is not None:   # an agent's entry stays as it always was
        out["opener"] = remote.opener
    return out
