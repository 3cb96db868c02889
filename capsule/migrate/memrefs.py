"""What a live move's memory codec (:mod:`ramdedup`) may send as references, and how the destination reads them.

- :func:`shared_objects` (source): the objects both hosts hold once the T0 version is pushed — every layer of its
  disks' chains (T0's own and the image's below them), its kernel and initrd, and the memory images of this
  capsule's older versions that the destination says it has (``POST /v1/objects/missing``). A page of the
  guest's page cache equals a block of the file it caches, so the layers alone catch much of memory; the kernel
  file stays in the guest's memory as QEMU loaded it, page-aligned (B2-live's tiny guest: 3,496 pages, 14 MB
  that do not compress); the kernel as it unpacks itself in the guest (``("kernel", FILE)``, made from the kernel
  file by :mod:`kernelimage` on both hosts, for a destination naming :data:`KERNEL_FEATURE`: 4,212 pages of the
  tiny guest, 4.0 MB as zstd); yesterday's memory image catches the rest of what did not change (the commute).
- :func:`known_of` (source): the :class:`~ramdedup.Known` hashes of those objects' manifests (8 bytes a block).
- :class:`StoreResolver` (destination): a hash → its 4 KiB, through this host's hash cache (every hit verified),
  then through the blocks of the objects the source named (an index built on the first miss). Objects this
  store does not hold are left out: a page only they had fails the move, cleanly."""

from __future__ import annotations

import sys
import threading
from typing import Any

from capsule.errors import Error, IntegrityError, InvalidName
from capsule.migrate.kernelimage import KernelImage
from capsule.migrate.memdelta import Similar
from capsule.migrate.memknown import Known, Objects
from capsule.migrate.ramstream import PAGE_SIZE
from capsule.migrate.tunnelset import Dedup
from capsule.names import check_object_id
from capsule.store import Store
from capsule.store.objectio import BlockReader, has_object, object_manifest
from hashcache.blocks import hash_block
from hashcache.manifest import Manifest

MAX_OBJECTS = 256                    # objects one move may name (a version's layers and a few memory images)
KERNEL_FEATURE = "memory-kernel"     # an agent that resolves blocks of ("kernel", FILE) names this feature
KINDS = ("layer", "file", "kernel")


def shared_objects(store: Store, version: Any, held_files: set[str] | None = None, *,
                   kernel: bool = False) -> Objects:
    """The objects of ``version``'s chains, its boot files, and the memory images of its capsule's other versions
    among ``held_files`` (what the destination holds; None: ask nothing, layers and boot files only);
    ``kernel``: also its kernel unpacked, if it unpacks (the destination names :data:`KERNEL_FEATURE`)."""
    out: Objects = [("layer", lid) for lid in dict.fromkeys(lid for chain in version.chains for lid in chain)]
    out += [("file", fid) for fid in dict.fromkeys(version.config.get(k) for k in ("kernel", "initrd")) if fid]
    if kernel and (fid := version.config.get("kernel")) and kernel_image(store, fid) is not None:
        out.append(("kernel", fid))
    if held_files:
        for v in store.catalogue.versions(version.capsule):
            if v.memory and v.memory in held_files and v.number != version.number:
                out.append(("file", v.memory))
    return out[:MAX_OBJECTS]


def memory_images(store: Store, capsule: str, number: int) -> list[str]:
    """The memory images of ``capsule``'s versions other than ``number`` (what to ask the destination about)."""
    return [v.memory for v in store.catalogue.versions(capsule) if v.memory and v.number != number]


def known_of(store: Store, objects: Objects) -> Known:
    """The hashes of ``objects``' blocks, and the unpacked kernels' blocks by their windows (``known.similar``: a
    page like one of them may go as a delta)."""
    manifests, similar = [], Similar()
    for n, (kind, oid) in enumerate(objects):
        if kind != "kernel":
            manifests.append(object_manifest(store, kind, oid))
            continue
        image = kernel_image(store, oid)
        if image is None:
            raise IntegrityError(f"the kernel file {oid[:12]} does not unpack here")
        manifests.append(image.manifest)
        similar.add(n, image.data)
    known = Known.of_manifests(manifests)
    known.similar = similar if similar else None
    return known


def kernel_image(store: Store, fid: str) -> KernelImage | None:
    """The kernel in the kernel file ``fid`` of this store, unpacked; None if the store holds no such kernel
    file, or it does not unpack (:func:`kernelimage.unpack`)."""
    row = store.catalogue.file(fid)
    if row is None or row.role != "kernel" or not has_object(store, "file", fid):
        return None
    try:
        return KernelImage.of(store.file_path(fid).read_bytes())
    except OSError:
        return None


def dedup_terms(store: Store, version: Any, client: Any) -> Dedup:
    """The memory codec's terms for moving ``version`` live to the agent ``client`` talks to (an AgentClient):
    after the push, the objects both hold (the destination asked which older memory images it has) and their
    hashes."""
    images = memory_images(store, version.capsule, version.number)
    held: set[str] = set()
    if images:
        lacking = client.post_json("/v1/objects/missing", {"layers": [], "files": images})
        held = set(images) - set(lacking.get("files", []) if isinstance(lacking, dict) else images)
    if not client.features:
        client.get_json("/v1/info")                       # (what it serves comes with every answer)
    objects = shared_objects(store, version, held, kernel=KERNEL_FEATURE in client.features)
    return Dedup(objects, known_of(store, objects))


def parse_objects(value: Any) -> Objects:
    """The ``objects`` of a tunnel request's ``dedup`` (a peer's words): [[KIND, ID], ...]."""
    if not isinstance(value, list) or len(value) > MAX_OBJECTS or not all(
            isinstance(o, list) and len(o) == 2 and o[0] in KINDS and isinstance(o[1], str) for o in value):
        raise InvalidName(f'malformed tunnel request: "dedup" is true or {{"objects": [[KIND, ID], ...]}} with '
                          f"KIND one of {', '.join(KINDS)} (at most {MAX_OBJECTS})")
    for _, oid in value:
        check_object_id(oid)
    return [(str(k), str(o)) for k, o in value]


class StoreResolver:
    """A hash → its block on this host (see the module's text); thread-safe."""

    def __init__(self, store: Store, objects: Objects | None = None) -> None:
        self.store = store
        self.named = list(objects or [])               # as the source numbers them (runs name them so)
        self.objects = [(k, o) for k, o in self.named if k == "kernel" or has_object(store, k, o)]
        self._index: dict[int, tuple[int, int]] | None = None
        self._readers: dict[int, BlockReader | KernelImage] = {}
        self._kernels: dict[str, KernelImage | None] = {}     # by file: unpacked once, on first use (about 0.2 s)
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
            if kind == "kernel":
                image = self._kernel(obj)
                return None if image is None else image.manifest
            self._manifests[obj] = object_manifest(self.store, kind, oid)
        return self._manifests[obj]

    def _kernel(self, obj: int) -> KernelImage | None:
        fid = self.named[obj][1]                   # (a source naming one kernel many times gets one copy)
        if fid not in self._kernels:
            self._kernels[fid] = kernel_image(self.store, fid)
        return self._kernels[fid]

    def _reader(self, obj: int) -> BlockReader | KernelImage:
        if obj not in self._readers:
            kind, oid = self.named[obj]
            image = self._kernel(obj) if kind == "kernel" else None
            self._readers[obj] = image if image is not None else BlockReader(self.store, kind, oid)
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


__all__ = ["KERNEL_FEATURE", "dedup_terms", "Objects", "StoreResolver", "kernel_image", "known_of", "memory_images",
           "parse_objects", "shared_objects"]
