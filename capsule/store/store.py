"""A host's store: the directory that holds sealed layers, file objects
(memory images, kernels, initrds), instance leaves and the catalogue.

Layout (all under ``home``)::

    store.json                 store id and format
    catalogue.sqlite           the catalogue (see catalogue.py)
    layers/<id>.qcow2          sealed layers, read-only, named by manifest digest
    layers/<id>.manifest
    layers/leaf-<uuid>.qcow2   private leaves of running instances (writable)
    files/<id>                 sealed memory images, kernels and initrds
    files/<id>.manifest
    instances/<capsule>/       console log and scratch of a running instance
    tmp/                       temporary files, renamed into place when complete
    recv/, remote/, shadows/   objects being received; remote layers of demand-paged disks
    busy/<capsule>             the claim of an operation under way on a capsule (claims.py; made on first use)

Modes (modes.py): the store and its directories 0700, memory images 0400,
other sealed objects and manifests 0440, whatever the umask.

Sealed layers reference their parent by the relative file name
``<parent-id>.qcow2``, so a layer file is the same on every host.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from pathlib import Path
from typing import Any

from capsule import __version__
from capsule.errors import EnvironmentProblem, IntegrityError, NotFound, SealedObjectError, StorageFull
from capsule.names import check_object_id
from capsule.store.catalogue import Catalogue, FileRow, LayerRow
from capsule.store.fsutil import disk_usage, install_readonly, is_enospc, make_private_dir, translating_enospc
from capsule.store.locks import lock_for
from capsule.store.modes import OBJECT_MODE, PRIVATE_FILE_MODE, SUBDIRS, file_mode, is_leftover
from hashcache.atomic import write_atomic
from hashcache.cache import HashCache
from hashcache.errors import HashcacheError
from hashcache.manifest import Manifest, manifest_of_file, manifest_of_layer

STORE_FORMAT = 1
DEFAULT_CACHE_SIZE = 64 << 20
Progress = Callable[[int, int], None] | None


SYSTEM_HOME = Path("/var/lib/capsule")


def default_home() -> Path:
    """CAPSULE_HOME; else, for root, /var/lib/capsule (guests' QEMU, which runs unprivileged, can reach it, and
    not a store in root's home); else the user's data directory."""
    env = os.environ.get("CAPSULE_HOME")
    if env:
        return Path(env).expanduser()
    if os.geteuid() == 0 and not os.environ.get("XDG_DATA_HOME"):
        return SYSTEM_HOME
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "capsule"


def check_format(meta_path: Path, store_format: object) -> None:
    """Refuse a store this release cannot read: made by a newer release, or with a format that is not one."""
    if type(store_format) is not int or store_format < 1:
        raise IntegrityError(f"{meta_path} names no store format this release knows ({str(store_format)[:20]!r}); "
                             "the store cannot be used")
    if store_format > STORE_FORMAT:
        raise EnvironmentProblem(
            f"the store at {meta_path.parent} was made by a newer Capsule (store format {store_format}); "
            f"capsule {__version__} reads store formats up to {STORE_FORMAT}: upgrade Capsule on this host "
            "(the store was left as it is)")


class Store:
    """One host's store. Open with ``Store.open(home)``; creates it if missing."""

    def __init__(self, home: Path, store_id: str, catalogue: Catalogue) -> None:
        self.home = home
        self.id = store_id
        self.catalogue = catalogue
        self.layers_dir = home / "layers"
        self.files_dir = home / "files"
        self.instances_dir = home / "instances"
        self.tmp_dir = home / "tmp"
        self._cache: HashCache | None = None

    @classmethod
    def open(cls, home: Path | None = None) -> Store:
        home = (home or default_home()).absolute()
        if not home.exists():
            home.parent.mkdir(parents=True, exist_ok=True)
            make_private_dir(home)
        for sub in SUBDIRS:
            make_private_dir(home / sub)
        meta_path = home / "store.json"
        if not meta_path.exists():
            with lock_for(home).hold(purpose="creating the store"):  # two first opens make one id
                if not meta_path.exists():
                    meta = {"id": secrets.token_hex(4), "format": STORE_FORMAT, "created": time.time()}
                    write_atomic(meta_path, json.dumps(meta).encode(), mode=PRIVATE_FILE_MODE)
        try:
            meta = json.loads(meta_path.read_text())
            store_id, store_format = meta["id"], meta.get("format", 1)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{meta_path} is unreadable ({exc}); the store cannot be used") from exc
        check_format(meta_path, store_format)
        catalogue_path = home / "catalogue.sqlite"
        new_catalogue = not catalogue_path.exists()
        catalogue = Catalogue(catalogue_path)
        if new_catalogue:
            for suffix in ("", "-wal", "-shm"):
                with suppress(FileNotFoundError):
                    os.chmod(f"{catalogue_path}{suffix}", PRIVATE_FILE_MODE)
        return cls(home, store_id, catalogue)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        self.catalogue.close()

    # -- the host's hash cache (§4.4.1) ------------------------------------------
    @property
    def cache_path(self) -> Path:
        return self.home / "hashcache.bin"

    def hash_cache(self) -> HashCache:
        """This host's persistent hash cache (created on first use; its size is
        fixed then: CAPSULE_HASHCACHE_SIZE bytes, default 64 MiB ≈ 1M blocks)."""
        if self._cache is None:
            size = int(os.environ.get("CAPSULE_HASHCACHE_SIZE", DEFAULT_CACHE_SIZE))
            try:
                self._cache = HashCache.open(self.cache_path, size_bytes=size)
            except HashcacheError as exc:
                if exc.__cause__ is not None and is_enospc(exc.__cause__):  # a full disk, not a bad cache
                    raise StorageFull(f"{exc}: the store's file system is full. Free space (capsule gc, "
                                      "capsule rm) or set a smaller CAPSULE_HASHCACHE_SIZE, and try again.") from exc
                raise IntegrityError(f"{exc} (the hash cache can always be deleted and rebuilt)") from exc
        return self._cache

    def index_object(self, path: Path, manifest: Manifest) -> None:
        """Insert every block of a sealed or received object into the hash cache."""
        # the cache is an optimisation: never fail a seal over it
        with suppress(HashcacheError, OSError, IntegrityError):
            self.hash_cache().insert_file(path, manifest)

    # -- locking ------------------------------------------------------------
    def lock(self, timeout: float | None = -1.0, purpose: str = "") -> AbstractContextManager[None]:
        """Exclusive lock for changes to the store, across threads and processes; re-entrant
        per thread (see locks.py). ``timeout`` in seconds, None: forever, default:
        CAPSULE_LOCK_TIMEOUT; a timeout raises ``LockTimeout`` naming the holder."""
        return lock_for(self.home).hold(timeout, purpose)

    def lock_holder(self) -> dict[str, Any] | None:
        """Who holds this store's lock now (host, pid, thread, command, since), or None."""
        return lock_for(self.home).holder()

    # -- paths ----------------------------------------------------------------
    def layer_path(self, layer_id: str) -> Path:
        return self.layers_dir / f"{check_object_id(layer_id, 'layer')}.qcow2"

    def layer_manifest_path(self, layer_id: str) -> Path:
        return self.layers_dir / f"{check_object_id(layer_id, 'layer')}.manifest"

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / check_object_id(file_id, "file")

    def file_manifest_path(self, file_id: str) -> Path:
        return self.files_dir / f"{check_object_id(file_id, 'file')}.manifest"

    def new_leaf_path(self) -> Path:
        return self.layers_dir / f"leaf-{uuid.uuid4().hex}.qcow2"

    def temp_path(self, suffix: str = "") -> Path:
        return self.tmp_dir / f"{uuid.uuid4().hex}{suffix}"

    def instance_dir(self, capsule: str) -> Path:
        return self.instances_dir / capsule

    def domain_name(self, capsule: str) -> str:
        """libvirt domain names are unique per store: several stores may share one libvirtd."""
        return f"capsule-{self.id}-{capsule}"

    def is_sealed(self, path: Path) -> bool:
        """True for any sealed layer or file object of this store."""
        path = path.absolute()
        if path.parent == self.files_dir:
            return True
        return path.parent == self.layers_dir and not path.name.startswith("leaf-")

    def assert_mutable(self, path: Path) -> None:
        if self.is_sealed(path):
            raise SealedObjectError(f"{path.name} is a sealed object of this store and never changes")

    # -- objects --------------------------------------------------------------
    def layer_manifest(self, layer_id: str) -> Manifest:
        path = self.layer_manifest_path(layer_id)
        if not path.exists():
            raise NotFound(f"layer {layer_id[:12]} has no manifest in this store")
        try:
            return Manifest.read(path)
        except HashcacheError as exc:
            raise IntegrityError(f"layer {layer_id[:12]}: {exc}") from exc

    def file_manifest(self, file_id: str) -> Manifest:
        path = self.file_manifest_path(file_id)
        if not path.exists():
            raise NotFound(f"file object {file_id[:12]} has no manifest in this store")
        try:
            return Manifest.read(path)
        except HashcacheError as exc:
            raise IntegrityError(f"file object {file_id[:12]}: {exc}") from exc

    def seal_layer(self, leaf: Path, parent: str | None, progress: Progress = None) -> LayerRow:
        """Hash ``leaf`` (whose backing is ``parent``), install it read-only as
        ``layers/<digest>.qcow2`` with its manifest, and return its catalogue row
        (not yet recorded: the caller records it in its transaction)."""
        self.assert_mutable(leaf)
        with translating_enospc(f"sealing layer {leaf.name}"):
            try:
                manifest = manifest_of_layer(leaf, parent, progress=progress)
            except HashcacheError as exc:
                if exc.__cause__ is not None and is_enospc(exc.__cause__):  # a full disk, not a bad cache
                    raise StorageFull(f"{exc}: the store's file system is full. Free space (capsule gc, "
                                      "capsule rm) or set a smaller CAPSULE_HASHCACHE_SIZE, and try again.") from exc
                raise IntegrityError(f"cannot seal {leaf.name}: {exc}") from exc
            layer_id = manifest.digest
            manifest_path = self.layer_manifest_path(layer_id)
            if not manifest_path.exists():
                manifest.write(manifest_path, mode=OBJECT_MODE)
            file_size = disk_usage(leaf)
            install_readonly(leaf, self.layer_path(layer_id), OBJECT_MODE)
        self.index_object(self.layer_path(layer_id), manifest)
        return LayerRow(
            id=layer_id,
            parent=parent,
            virtual_size=manifest.size,
            file_size=file_size,
            stored_bytes=manifest.stored_bytes,
            blocks=len(manifest),
            created=time.time(),
        )

    def seal_file(self, path: Path, role: str, progress: Progress = None) -> FileRow:
        """Hash a finished file (a memory image, kernel or initrd), install it
        read-only as ``files/<digest>`` with its manifest; return its row."""
        with translating_enospc(f"sealing {role} {path.name}"):
            manifest = manifest_of_file(path, progress=progress)
            file_id = manifest.digest
            manifest_path = self.file_manifest_path(file_id)
            if not manifest_path.exists():
                manifest.write(manifest_path, mode=OBJECT_MODE)
            size = path.stat().st_size
            allocated = disk_usage(path)
            install_readonly(path, self.file_path(file_id), file_mode(role))
        self.index_object(self.file_path(file_id), manifest)
        return FileRow(
            id=file_id,
            role=role,
            size=size,
            allocated=allocated,
            stored_bytes=manifest.stored_bytes,
            created=time.time(),
        )

    def clean_tmp(self, older_than: float = 3600.0) -> int:
        """Remove leftovers of interrupted operations: tmp/'s files, and the temporary files of atomic writes
        beside the objects (a manifest being written when its writer was killed) — both older than
        ``older_than`` seconds, so a write under way is never touched."""
        removed = 0
        now = time.time()
        leftovers = [*self.tmp_dir.iterdir(),
                     *(p for d in (self.layers_dir, self.files_dir) for p in d.iterdir() if is_leftover(p))]
        for p in leftovers:
            with suppress(FileNotFoundError):
                if now - p.lstat().st_mtime > older_than:
                    p.unlink()
                    removed += 1
        return removed
