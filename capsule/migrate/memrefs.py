"""What a live move's memory codec (:mod:`ramdedup`) may send as references, and how the destination reads them.

- :func:`shared_objects` (source): the objects both hosts hold once the T0 version is pushed — every layer of its
  disks' chains (T0's own and the image's below them), its kernel and initrd, and the memory images of this
  capsule's older versions that the destination says it has (``POST /v1/objects/missing``). A page of the
  guest's page cache equals a block of the file it caches, so the layers alone catch much of memory; the kernel
  file stays in the guest's memory as QEMU loaded it, page-aligned (B2-live's tiny guest: 3,496 pages, 14 MB
  that do not compress); yesterday's memory image catches the rest of what did not change (the commute).
- :func:`known_of` (source): the :class:`~ramdedup.Known` hashes of those objects' manifests (8 bytes a block).
- :class:`StoreResolver` (destination): a hash → its 4 KiB, through this host's hash cache (every hit verified),
  then through the blocks of the objects the source named (an index built on the first miss). Objects this
  store does not hold are left out: a page only they had fails the move, cleanly."""

from __future__ import annotations

import sys
import threading
from typing import Any

from capsule.errors import Error, IntegrityError, InvalidName
from capsule.migrate.memknown import Known, Objects
from capsule.migrate.ramstream import PAGE_SIZE
from capsule.migrate.tunnelset import Dedup
from capsule.names import check_object_id
from capsule.store import Store
from capsule.store.objectio import BlockReader, has_object, object_manifest
from hashcache.blocks import hash_block
from hashcache.manifest import Manifest

MAX_OBJECTS = 256                    # objects one move may name (a version's layers and a few memory images)


def shared_objects(store: Store, version: Any, held_files: set[str] | None = None) -> Objects:
    """The objects of ``version``'s chains, its boot files, and the memory images of its capsule's other versions
    among ``held_files`` (what the destination holds; None: ask nothing, layers and boot files only)."""
    out: Objects = [("layer", lid) for lid in dict.fromkeys(lid for chain in version.chains for lid in chain)]
    out += [("file", fid) for fid in dict.fromkeys(version.config.get(k) for k in ("kernel", "initrd")) if fid]
    if held_files:
        for v in store.catalogue.versions(version.capsule):
            if v.memory and v.memory in held_files and v.number != version.number:
                out.append(("file", v.memory))
    return out[:MAX_OBJECTS]


def memory_images(store: Store, capsule: str, number: int) -> list[str]:
    """The memory images of ``capsule``'s versions other than ``number`` (what to ask the destination about)."""
    return [v.memory for v in store.catalogue.versions(capsule) if v.memory and v.number != number]


def known_of(store: Store, objects: Objects) -> Known:
    return Known.of_manifests(object_manifest(store, kind, oid) for kind, oid in objects)


def dedup_terms(store: Store, version: Any, client: Any) -> Dedup:
    """The memory codec's terms for moving ``version`` live to the agent ``client`` talks to (an AgentClient):
    after the push, the objects both hold (the destination asked which older memory images it has) and their
    hashes."""
    images = memory_images(store, version.capsule, version.number)
    held: set[str] = set()
    if images:
        lacking = client.post_json("/v1/objects/missing", {"layers": [], "files": images})
        held = set(images) - set(lacking.get("files", []) if isinstance(lacking, dict) else images)
    objects = shared_objects(store, version, held)
    return Dedup(objects, known_of(store, objects))


def parse_objects(value: Any) -> Objects:
    """The ``objects`` of a tunnel request's ``dedup`` (a peer's words): [[KIND, ID], ...]."""
    if not isinstance(value, list) or len(value) > MAX_OBJECTS or not all(
            isinstance(o, list) and len(o) == 2 and o[0] in ("layer", "file") and isinstance(o[1], str)
            for o in value):
        raise InvalidName(f'malformed tunnel request: "dedup" is true or {{"objects": [["layer" or "file", ID], '
                          f"...]}} (at most {MAX_OBJECTS})")
    for _, oid in value:
        check_object_id(oid)
    return [(str(k), str(o)) for k, o in value]


class StoreResolver:
    """A hash → its block on this host (see the module's text); thread-safe."""

    def __init__(self, store: Store, objects: Objects | None = None) -> None:
        self.store = store
        self.named = list(objects or [])               # as the source numbers them (runs name them so)
        self.objects = [(k, o) for k, o in self.named if has_object(store, k, o)]
        self._index: dict[int, tuple[int, int]] | None = None
        self._readers: dict[int, BlockReader] = {}
        self._manifests: dict[int, Manifest] = {}
        self._lock = threading.Lock()

    def blocks(self, obj: int, first: int, count: int) -> list[bytes]:
        """Blocks ``first .. first+count`` of the object the source numbered ``obj``, each checked against its
        manifest here; IntegrityError if the object is not held here, or a block is not listed or differs."""
        if not 0 <= obj < len(self.named):
            raise IntegrityError(f"the memory stream names object {obj} of the {len(self.named)} the source named")
        kind, oid = self.named[obj]
        with self._lock:
            m = self._manifest(obj)
            if m is None:
                raise IntegrityError(f"the memory stream refers to {kind} {oid[:12]}, which this host does not "
                                     "hold: the move fails and the guest runs on at the source")
            hashes = [m.record(b) for b in range(first, first + count)]
            bad = next((first + i for i, r in enumerate(hashes) if r is None or r[0]), None)
            if bad is not None:
                raise IntegrityError(f"the memory stream refers to block {bad} of {kind} {oid[:12]}, which holds no "
                                     "data there")
            try:
                pages = self._reader(obj).read(list(range(first, first + count)))
            except Error as exc:
                raise IntegrityError(f"blocks {first}..{first + count - 1} of {kind} {oid[:12]} cannot be read here: "
                                     f"{exc}") from None
        for i, (page, record) in enumerate(zip(pages, hashes, strict=True)):
            assert record is not None
            if len(page) != PAGE_SIZE or hash_block(page) != record[1]:
                raise IntegrityError(f"block {first + i} of {kind} {oid[:12]} read here does not match its manifest: "
                                     "refused (the memory stream is not rebuilt from it)")
        return pages

    def _manifest(self, obj: int) -> Manifest | None:
        """The manifest of the object numbered ``obj``, read once; None if this store does not hold it (the caller
        holds the lock)."""
        if obj not in self._manifests:
            kind, oid = self.named[obj]
            if (kind, oid) not in self.objects:
                return None
            self._manifests[obj] = object_manifest(self.store, kind, oid)
        return self._manifests[obj]

    def _reader(self, obj: int) -> BlockReader:
        if obj not in self._readers:
            kind, oid = self.named[obj]
            self._readers[obj] = BlockReader(self.store, kind, oid)
        return self._readers[obj]

    def __call__(self, h: bytes) -> bytes | None:
        try:
            page = self.store.hash_cache().lookup(h)
        except Error:
            page = None
        if page is not None:
            return page
        with self._lock:
            if self._index is None:
                self._index = self._build()
            place = self._index.get(int.from_bytes(h[:8], sys.byteorder))
            if place is None:
                return None
            obj, block = place
            try:
                return self._reader(obj).read([block])[0]
            except Error:
                return None

    def _build(self) -> dict[int, tuple[int, int]]:
        index: dict[int, tuple[int, int]] = {}
        for n in range(len(self.named)):
            m = self._manifest(n)
            if m is None:
                continue
            for block, zero, digest in m.records():
                if not zero:
                    index.setdefault(int.from_bytes(digest[:8], sys.byteorder), (n, block))
        return index

    def close(self) -> None:
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()


__all__ = ["dedup_terms", "Objects", "StoreResolver", "known_of", "memory_images", "parse_objects", "shared_objects"]
