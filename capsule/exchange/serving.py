"""Serving this store's sealed objects to peers (HCP §4.4.3, the stateless side): LOOKUP (a manifest's
header), READ-HASH (its records) and READ (blocks), plus the small questions a pushing peer asks."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import zstandard

from capsule.accounts import grants
from capsule.accounts.model import Grant
from capsule.capsules import resolve
from capsule.errors import InvalidName
from capsule.exchange import holdings
from capsule.names import check_name, check_object_id
from capsule.store import Store
from capsule.store.objectio import ReaderCache, has_object, object_manifest
from capsule.transfer.records import version_record
from hashcache.hcp import (
    PREFIX_SIZE,
    compact_records,
    compress_like,
    decode_indices,
    header_of,
    like_records,
    pack_blocks,
)
from hashcache.manifest import Manifest

MAX_RECORDS = 1 << 20


class ObjectServer:
    """Manifests (read and checked once: sealed objects never change) and open readers of one store,
    shared by every request thread."""

    def __init__(self, store: Store, readers: int = 32, manifests: int = 64) -> None:
        self.store = store
        self.readers = ReaderCache(store, readers)
        self._manifests: OrderedDict[tuple[str, str], Manifest] = OrderedDict()
        self._manifests_size = manifests
        self._lock = threading.Lock()

    def close(self) -> None:
        self.readers.close()

    def cached_manifest(self, kind: str, oid: str) -> Manifest | None:
        key = (kind, oid)
        with self._lock:
            m = self._manifests.get(key)
            if m is not None:
                self._manifests.move_to_end(key)
            return m

    def manifest(self, kind: str, oid: str) -> Manifest:
        m = self.cached_manifest(kind, oid)
        if m is not None:
            return m
        m = object_manifest(self.store, kind, oid)  # checks kind and id
        with self._lock:
            self._manifests[(kind, oid)] = m
            while len(self._manifests) > self._manifests_size:
                self._manifests.popitem(last=False)
        return m

    def lookup(self, kind: str, oid: str) -> dict[str, Any]:
        """LOOKUP: the manifest's header, and a file object's role."""
        head = header_of(self.manifest(kind, oid))
        if kind == "file":
            row = self.store.catalogue.file(oid)
            head["role"] = row.role if row else "memory"
        return head

    def records(self, kind: str, oid: str, start: int = 0, count: int = MAX_RECORDS, hash_len: int = 32,
                like: str | None = None, reader: Grant | None = None) -> tuple[bytes, int, str | None]:
        """READ-HASH: (zstd of ``count`` records from ``start``, hashes cut to ``hash_len``; how many; the span
        ``FIRST-LAST`` of blocks whose records of file ``like`` the zstd was compressed against, or None). A
        ``like`` this store does not hold, or ``reader`` may not read, is not used (``hashcache.hcp.like_records``:
        the caller holds it and makes the same records)."""
        m = self.manifest(kind, oid)
        if start < 0 or count < 0 or count > MAX_RECORDS or hash_len not in (PREFIX_SIZE, 32):
            raise InvalidName(f"bad record range start={start} count={count} hash_len={hash_len}")
        n = min(count, max(0, len(m) - start))
        raw = compact_records(m, start, n, hash_len)
        if like is not None and n and holdings.readable_file(self.store, reader, check_object_id(like)):
            first, last = m.record_range(start, 1)[:8], m.record_range(start + n - 1, 1)[:8]
            span = (int.from_bytes(first, "little") >> 1, int.from_bytes(last, "little") >> 1)
            dictionary = like_records(self.manifest("file", like), *span, hash_len)
            if dictionary:
                return compress_like(raw, dictionary), n, f"{span[0]}-{span[1]}"
        return zstandard.ZstdCompressor(level=3).compress(raw), n, None

    def indices(self, kind: str, oid: str, raw: bytes) -> list[int]:
        """The block indices of a READ request (varints), checked against the object's size."""
        return decode_indices(raw, self.manifest(kind, oid).block_count)

    def read(self, kind: str, oid: str, indices: list[int], level: int = 3, compress: bool = True) -> bytes:
        """READ: the blocks at ``indices``, packed (zstd at ``level`` unless ``compress`` is false)."""
        if not 1 <= level <= 19:
            raise InvalidName("zstd level must be 1..19")
        with self.readers.lease(kind, oid) as reader:
            blocks = reader.read(indices)
        return pack_blocks(blocks, level=level, compress=compress)


def missing(store: Store, layers: Any, files: Any, reader: Grant | None = None) -> dict[str, list[str]]:
    """Which of these objects this store lacks (ids checked: they come from a peer). ``reader``: the grant
    asking (None: a user's token); an object it may not read is answered missing whether held or not (a push
    grant is then refused it: it pushes only its record's objects)."""
    try:
        layer_ids = [check_object_id(x) for x in layers]
        file_ids = [check_object_id(x) for x in files]
    except TypeError as exc:
        raise InvalidName(f"malformed request: {exc}") from exc
    may_layers, may_files = grants.readable(store, reader) if reader is not None else (None, None)
    return {"layers": [x for x in layer_ids if not has_object(store, "layer", x)
                       or (may_layers is not None and x not in may_layers)],
            "files": [x for x in file_ids if not has_object(store, "file", x)
                      or (may_files is not None and x not in may_files)]}


def capsule_list(store: Store) -> list[dict[str, Any]]:
    """Each capsule: its versions, and the version its running instance started from (or None)."""
    running = {inst.capsule: inst.version for inst in store.catalogue.instances()}
    return [{"name": cap.name, "uuid": cap.uuid, "versions": [v.number for v in store.catalogue.versions(cap.name)],
             "running": running.get(cap.name)}
            for cap in store.catalogue.capsules()]


def version_of(store: Store, name: str, number: str) -> dict[str, Any]:
    """The travelling record of ``name``'s version ``number`` (or ``latest``)."""
    check_name(name)
    return version_record(store, resolve(store, name if number == "latest" else f"{name}@{number}"))

