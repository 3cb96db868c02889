"""Reading sealed objects block by block (the serving side of HCP) and
installing objects received block by block into a store."""

from __future__ import annotations

import os
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

from capsule.errors import Conflict, IntegrityError, InvalidName, NotFound
from capsule.exchange.leases import LeaseCache
from capsule.names import check_object_id
from capsule.pod import POD_IMAGE_ROLE
from capsule.store.catalogue import FileRow, LayerRow
from capsule.store.fsutil import disk_usage, install_readonly, translating_enospc
from capsule.store.modes import OBJECT_MODE, file_mode
from capsule.store.store import Store
from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import HashcacheError
from hashcache.hcp import Expectation
from hashcache.manifest import Manifest, manifest_of_file, manifest_of_layer
from hashcache.qcow2 import Qcow2Image
from hashcache.qcow2_writer import write_layer
from hashcache.shadow import Shadow, ShadowError

KINDS = ("layer", "file")
FILE_ROLES = ("memory", "kernel", "initrd", POD_IMAGE_ROLE)  # a pod image travels alone (pod migrate --on HOST)


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise InvalidName(f"unknown object kind {kind!r}: expected one of {', '.join(KINDS)}")
    return kind


def object_manifest(store: Store, kind: str, oid: str) -> Manifest:
    check_kind(kind)
    check_object_id(oid)
    if kind == "layer":
        if store.catalogue.layer(oid) is None:
            raise NotFound(f"no layer {oid[:12]} in this store")
        return store.layer_manifest(oid)
    if store.catalogue.file(oid) is None:
        raise NotFound(f"no file object {oid[:12]} in this store")
    return store.file_manifest(oid)


def object_path(store: Store, kind: str, oid: str) -> Path:
    return store.layer_path(oid) if check_kind(kind) == "layer" else store.file_path(oid)


def has_object(store: Store, kind: str, oid: str) -> bool:
    check_object_id(oid)
    row = store.catalogue.layer(oid) if check_kind(kind) == "layer" else store.catalogue.file(oid)
    return row is not None and object_path(store, kind, oid).exists()


class BlockReader:
    """Reads 4 KiB guest blocks of one sealed object (thread-safe)."""

    def __init__(self, store: Store, kind: str, oid: str) -> None:
        self.kind = kind
        self.path = object_path(store, kind, oid)
        self._lock = threading.Lock()
        self._img = Qcow2Image(self.path) if kind == "layer" else None
        self._fd_data = os.open(self.path, os.O_RDONLY)
        self._closed = False

    def read(self, indices: list[int]) -> list[bytes]:
        """The blocks at ``indices``; blocks adjacent in the file are read with one pread."""
        with self._lock:
            if self._closed:
                raise Conflict(f"the reader of {self.path.name} was closed")
            places: list[int | None] = []
            for i in indices:
                if self._img is not None:
                    found = self._img.block_kind(i)
                    if found is None:
                        raise NotFound(f"block {i} is not allocated in layer {self.path.name}")
                    places.append(found[1])  # None: a zero block
                else:
                    places.append(i * BLOCK_SIZE)
            out: list[bytes] = []
            pos = 0
            while pos < len(indices):
                start = places[pos]
                if start is None:
                    out.append(bytes(BLOCK_SIZE))
                    pos += 1
                    continue
                if self._img is not None and (indices[pos] + 1) * BLOCK_SIZE > self._img.virtual_size:
                    out.append(self._img.read_block(indices[pos]) or bytes(BLOCK_SIZE))  # short last block
                    pos += 1
                    continue
                end = pos + 1
                while end < len(indices) and places[end] == start + (end - pos) * BLOCK_SIZE:
                    end += 1
                data = os.pread(self._fd_data, (end - pos) * BLOCK_SIZE, start)
                data = data.ljust((end - pos) * BLOCK_SIZE, b"\0")
                out.extend(data[k * BLOCK_SIZE:(k + 1) * BLOCK_SIZE] for k in range(end - pos))
                pos = end
            return out

    def own(self, index: int) -> bool | None:
        """Whether this layer holds block ``index`` itself: True (data), False (a zero block), None (not
        allocated here: its backing layer says; also a block beyond the disk)."""
        if self._img is None:
            return True
        with self._lock:
            if self._closed:
                raise Conflict(f"the reader of {self.path.name} was closed")
            try:
                found = self._img.block_kind(index)
            except IndexError:
                return None
        return None if found is None else found[1] is not None

    def close(self) -> None:
        """Close the files (once; a read running in another thread finishes first)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._img is not None:
                self._img.close()
            os.close(self._fd_data)

    def __enter__(self) -> BlockReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ChainReader:
    """Reads 4 KiB blocks of the disk a layer shows: the layer's own, else its parent's, and so on (a block
    no layer holds reads as zeros)."""

    def __init__(self, store: Store, top: str) -> None:
        row = store.catalogue.layer(top)
        if row is None:
            raise NotFound(f"no layer {top[:12]} in this store")
        self.block_count = -(-row.virtual_size // BLOCK_SIZE)
        self.readers: list[BlockReader] = []
        try:
            lid: str | None = top
            while lid is not None:
                self.readers.append(BlockReader(store, "layer", lid))
                parent = store.catalogue.layer(lid)
                lid = parent.parent if parent is not None else None
        except BaseException:
            self.close()
            raise

    def read(self, index: int) -> bytes | None:
        """The block at ``index``; None beyond the disk."""
        if not 0 <= index < self.block_count:
            return None
        for reader in self.readers:
            own = reader.own(index)
            if own is None:
                continue
            return reader.read([index])[0] if own else bytes(BLOCK_SIZE)
        return bytes(BLOCK_SIZE)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self) -> ChainReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ReaderCache:
    """Open BlockReaders of one store (sealed objects never change), shared by threads:
    ``with readers.lease(kind, oid) as reader:``. A reader is closed only once nobody reads through it."""

    def __init__(self, store: Store, size: int = 32) -> None:
        self.store = store
        self._cache: LeaseCache[tuple[str, str], BlockReader] = LeaseCache(
            lambda key: BlockReader(store, *key), BlockReader.close, size)

    def lease(self, kind: str, oid: str) -> AbstractContextManager[BlockReader]:
        return self._cache.lease((kind, oid))

    def close(self) -> None:
        self._cache.close()


# -- receiving ------------------------------------------------------------------

def recv_base(store: Store, kind: str, oid: str) -> Path:
    d = store.home / "recv"
    d.mkdir(exist_ok=True)
    return d / f"{check_kind(kind)}-{check_object_id(oid)}"


def open_shadow(store: Store, kind: str, manifest: Manifest | Expectation, *, fresh: bool = False) -> Shadow:
    """The shadow receiving ``manifest``'s object. ``fresh`` (a new transfer): a shadow left by an earlier
    receive of this id under a manifest of another size, or unreadable, is thrown away and started
    again — its blocks were checked against hashes this object cannot have (the id is the manifest's
    digest, and a complete object is verified against it before it is installed)."""
    base = recv_base(store, kind, manifest.digest)
    try:
        return Shadow(base, manifest.block_count)
    except ShadowError:
        if not fresh:
            raise
    for suffix in (".data", ".bitmap"):
        base.with_name(base.name + suffix).unlink(missing_ok=True)
    return Shadow(base, manifest.block_count)


def install_received(store: Store, kind: str, manifest: Manifest, shadow: Shadow, role: str = "memory", *,
                     hashed: bool = False) -> LayerRow | FileRow:
    """Turn a complete shadow into a sealed object of this store, verified
    against the manifest (its digest is the object's name), and record it —
    as *pending*, so gc keeps it until a version that uses it is recorded.
    ``hashed``: the manifest's hashes were just computed from this shadow's blocks
    (``Receiver.finish``), so a file object is not hashed a second time; a layer file,
    rebuilt here from the blocks, always is."""
    oid = manifest.digest
    row: LayerRow | FileRow
    with store.lock(), translating_enospc(f"installing {kind} {oid[:12]}"):
        if kind == "layer":
            if manifest.parent and not has_object(store, "layer", manifest.parent):
                raise Conflict(f"layer {oid[:12]} needs its parent {manifest.parent[:12]} first")
            # built in tmp/ (never a leaf-* in layers/: an agent killed here must leave nothing `verify`
            # reads as a layer or a leaf; tmp/ is cleaned of leftovers), renamed into layers/ when sealed
            tmp = store.temp_path(".qcow2")
            try:
                write_layer(tmp, virtual_size=manifest.size,
                            backing=f"{manifest.parent}.qcow2" if manifest.parent else None,
                            records=((i, z) for i, z, _h in manifest.records()), read_block=shadow.read)
                got = manifest_of_layer(tmp, manifest.parent)
                if got.digest != oid:
                    raise IntegrityError(f"layer {oid[:12]}: the rebuilt layer does not match its manifest")
                if not store.layer_manifest_path(oid).exists():
                    manifest.write(store.layer_manifest_path(oid), mode=OBJECT_MODE)
                file_size = disk_usage(tmp)
                install_readonly(tmp, store.layer_path(oid), OBJECT_MODE)
            except HashcacheError as exc:
                raise IntegrityError(f"layer {oid[:12]}: {exc}") from exc
            finally:
                tmp.unlink(missing_ok=True)
            row = LayerRow(oid, manifest.parent, manifest.size, file_size,
                           manifest.stored_bytes, len(manifest), time.time())
            with store.catalogue.transaction():
                store.catalogue.add_layer(row)
                store.catalogue.add_pending(kind, oid)
        else:
            if role not in FILE_ROLES:
                raise InvalidName(f"unknown file role {role!r}")
            data_path = shadow.data_path
            shadow.close()
            os.truncate(data_path, manifest.size)
            got = manifest if hashed else manifest_of_file(data_path)
            if got.digest != oid:
                raise IntegrityError(f"{role} {oid[:12]}: the received file does not match its manifest")
            if not store.file_manifest_path(oid).exists():
                manifest.write(store.file_manifest_path(oid), mode=OBJECT_MODE)
            allocated = disk_usage(data_path)
            install_readonly(data_path, store.file_path(oid), file_mode(role))
            row = FileRow(oid, role, manifest.size, allocated, manifest.stored_bytes, time.time())
            with store.catalogue.transaction():
                store.catalogue.add_file(row)
                store.catalogue.add_pending(kind, oid)
        shadow.remove()
        return row
