"""Pushing a capsule version into a repository: only the blocks it lacks are uploaded.

A writer session: take a shared lock, load every index (the blocks the repository holds, whoever wrote them),
then for each of the version's layers and files whose manifest the repository lacks, seal its new non-zero
blocks into packs of a few MiB and upload them; then one index for the session's packs, then the manifests,
then the version record, in that order — a record is visible only once everything it names is."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import zstandard

from capsule.capsules import resolve
from capsule.errors import Conflict, IntegrityError, NotFound
from capsule.repo.format import (
    Entry,
    PackWriter,
    Place,
    encode_index,
    is_id,
    pack_name,
    pack_trailer,
    read_pack_header_only,
)
from capsule.repo.repository import Lock, Repository
from capsule.repo.uploads import Uploads
from capsule.store import Store
from capsule.store.objectio import BlockReader, has_object, object_manifest
from capsule.transfer.records import objects_of, version_record
from hashcache.blocks import BLOCK_SIZE

RUN = 256   # blocks read from a store object at once


@dataclass
class PushReport:
    version: str
    url: str
    record: str = ""
    objects: int = 0              # layers and files of the version
    objects_present: int = 0      # … whose manifest the repository held already
    blocks: int = 0               # non-zero blocks of the objects it lacked
    blocks_new: int = 0           # … it lacked (uploaded)
    blocks_known: int = 0         # … already held (in a pack from any host, or earlier in this push)
    raw_bytes: int = 0            # the bytes of ``blocks``
    new_bytes: int = 0            # the bytes of ``blocks_new`` before compression and sealing
    blobs: int = 0                # sealed blobs holding them (format 2: up to 16 blocks each)
    packs: int = 0
    packs_adopted: int = 0        # unindexed packs of an interrupted push, whose blocks were not sent again
    uploaded_bytes: int = 0       # every object body sent to the store (packs, index, manifests, record, lock)
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Progress = Callable[[str], None]


def _noop(_msg: str) -> None:
    pass


class _Session:
    def __init__(self, repo: Repository, known: set[bytes], report: PushReport, progress: Progress,
                 lock: Lock, uploads: Uploads) -> None:
        self.repo = repo
        self.uploads = uploads
        self.lock = lock
        self.known = known
        self.report = report
        self.progress = progress
        self.pack = PackWriter(repo.key)
        self.packs: dict[str, dict[bytes, Place]] = {}
        self.group_size = repo.blob_blocks
        self.group: list[tuple[bytes, bytes]] = []

    def add(self, block_id: bytes, data: bytes) -> None:
        """One new block; neighbours are gathered into one blob (format 2) until :meth:`end_group`."""
        self.known.add(block_id)
        if self.group_size == 1:
            self.pack.add(block_id, data)
            self.report.blobs += 1
        else:
            self.group.append((block_id, data))
            if len(self.group) < self.group_size:
                return
            self._seal_group()
        if self.pack.size >= self.repo.pack_size:
            self.flush()

    def _seal_group(self) -> None:
        if self.group:
            self.pack.add_group(self.group)
            self.report.blobs += 1
            self.group = []

    def end_group(self) -> None:
        """Seal the blocks gathered so far (an object's last ones: a blob holds one object's blocks)."""
        self._seal_group()
        if self.pack.size >= self.repo.pack_size:
            self.flush()

    def flush(self) -> None:
        self._seal_group()
        if not len(self.pack):
            return
        body = self.pack.finish()
        self.uploads.put(self.repo.location.key(pack_name(self.pack.id)), body)   # in the background
        self.packs[self.pack.id] = dict(self.pack.entries)
        self.report.packs += 1
        self.progress(f"{self.report.packs} pack(s), {self.report.blocks_new} new block(s)")
        self.pack = PackWriter(self.repo.key)
        self.lock.refresh(if_due=True)    # a long push keeps its lock fresh: prune never takes it for dead


def _push_object(session: _Session, store: Store, kind: str, oid: str) -> bytes:
    """Seal the object's blocks the repository lacks; the manifest's bytes (to be written after the index)."""
    manifest = object_manifest(store, kind, oid)
    report, key = session.report, session.repo.key
    wanted: list[tuple[int, bytes]] = []
    for index, zero, block_hash in manifest.records():
        if zero:
            continue
        report.blocks += 1
        report.raw_bytes += BLOCK_SIZE
        bid = key.block_id(block_hash)
        if bid in session.known:
            report.blocks_known += 1
            continue
        session.known.add(bid)     # a repeat within this object is sent once
        wanted.append((index, bid))
    with BlockReader(store, kind, oid) as reader:
        for start in range(0, len(wanted), RUN):
            run = wanted[start:start + RUN]
            for (_index, bid), data in zip(run, reader.read([i for i, _ in run]), strict=True):
                session.add(bid, data)
                report.blocks_new += 1
                report.new_bytes += BLOCK_SIZE
    session.end_group()
    return manifest.to_bytes()


def adopt_unindexed(repo: Repository, index: dict[bytes, Entry], session: _Session) -> None:
    """Packs no index lists — an interrupted push's (the store or this host died before its index was
    written), or one still being written by another host's push — are read (their sealed headers only) and
    listed in this session's index: their blocks are not uploaded again, so a push killed half-way resumes.
    Listing a live writer's pack twice is harmless (packs never change; prune runs alone)."""
    indexed = {e.pack for e in index.values()}
    for name, size in repo.names("packs"):
        pack = name.rsplit("/", 1)[-1]
        if pack in indexed or not is_id(pack) or size < 4:
            continue
        try:
            key = repo.location.key(name)
            tail = min(8, size)
            start, hlen = pack_trailer(repo.client.get(key, size - tail, tail), size, pack)
            header = read_pack_header_only(repo.key, pack, repo.client.get(key, start, hlen), start)
        except (IntegrityError, NotFound):
            continue      # damaged, or gone since the listing: `repo check` and prune deal with it
        session.packs[pack] = header
        session.known.update(header)
        session.report.packs_adopted += 1


def push(store: Store, ref: str, repo: Repository, progress: Progress = _noop) -> PushReport:
    """Store ``NAME[@V]`` in ``repo``; what the repository held already (any capsule's, any host's) is not
    uploaded again."""
    t0 = time.monotonic()
    v = resolve(store, ref)
    record = version_record(store, v)
    report = PushReport(f"{v.capsule}@{v.number}", repo.location.url)
    sent0 = repo.client.sent_bytes
    layers, files = objects_of(record)
    items = [("layer", lid, "layer") for lid in layers] + [("file", fid, role) for fid, role in files]
    for kind, oid, _role in items:
        if not has_object(store, kind, oid):
            raise Conflict(f"{v.capsule}@{v.number}: its {kind} {oid[:12]} is not in this store (demand-paged "
                           "from a peer?): localize it first")
    with contextlib.ExitStack() as stack:
        lock = stack.enter_context(repo.lock())
        progress("reading the repository's indexes")
        index, _names = repo.load_index()
        present = repo.manifest_names()
        uploads = stack.enter_context(Uploads(repo.client))
        session = _Session(repo, set(index), report, progress, lock, uploads)
        adopt_unindexed(repo, index, session)
        manifests: dict[str, bytes] = {}
        objects = []
        for kind, oid, role in items:
            name = repo.key.object_name(kind, oid)
            objects.append({"kind": kind, "id": oid, "role": role, "manifest": name})
            report.objects += 1
            if name in present or name in manifests:
                report.objects_present += 1
                report.skipped.append(oid)
                continue
            progress(f"{role} {oid[:12]}")
            manifests[name] = _push_object(session, store, kind, oid)
            lock.refresh(if_due=True)
        session.flush()
        uploads.wait()      # every pack stored before the index that names them
        if session.packs:
            repo.put_sealed(f"index/{_new_name()}", encode_index(session.packs))
        compressor = zstandard.ZstdCompressor(level=3)
        for name, body in manifests.items():
            repo.put_sealed(f"manifests/{name}", compressor.compress(body))
        report.record = f"versions/{_new_name()}"
        repo.put_json(report.record, {"format": 1, "record": record, "objects": objects,
                                      "host": socket.gethostname(), "pushed": time.time()})
    report.uploaded_bytes = repo.client.sent_bytes - sent0
    report.seconds = round(time.monotonic() - t0, 3)
    return report


def _new_name() -> str:
    from capsule.repo.format import new_id

    return new_id()
