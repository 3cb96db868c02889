"""Restoring a capsule version from a repository into a store: each layer and file the store lacks is rebuilt
from its manifest and its blocks (fetched by byte range from their packs, opened, and checked against the
manifest's hashes), verified against its digest and installed; the version is recorded last."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from typing import Any

import zstandard

from capsule.errors import IntegrityError, NotFound, Unreachable
from capsule.names import parse_ref
from capsule.repo.format import Entry, open_range, pack_name, ranges
from capsule.repo.repository import Repository
from capsule.store import Store
from capsule.store.fsutil import translating_enospc
from capsule.store.objectio import has_object, install_received, object_path, open_shadow
from capsule.transfer.records import record_version, validate
from hashcache.blocks import hash_block
from hashcache.errors import HashcacheError
from hashcache.manifest import Manifest

MAX_MANIFEST = 1 << 30


@dataclass
class RestoreReport:
    version: str
    url: str
    objects: int = 0
    objects_present: int = 0      # already in the store
    blocks: int = 0
    downloaded_bytes: int = 0
    seconds: float = 0.0
    recorded: bool = False
    installed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_version(repo: Repository, ref: str) -> tuple[str, dict[str, Any]]:
    """The record of ``NAME@V`` (``NAME``: its highest version) in the repository."""
    r = parse_ref(ref)
    found = [(name, body) for name, body in repo.versions() if body["record"]["capsule"] == r.name
             and (r.version is None or body["record"]["number"] == r.version)]
    if not found:
        raise NotFound(f"the repository at {repo.location.url} holds no {ref} (`capsule repo ls` lists what it "
                       "holds)")
    return max(found, key=lambda nb: (nb[1]["record"]["number"], nb[1].get("pushed", 0)))


def version_body(repo: Repository, ref: str) -> tuple[dict[str, Any], list[tuple[str, str, str, str]]]:
    """The validated version record of ``NAME[@V]`` (:func:`find_version`) and its objects, each (kind, id,
    role, manifest name); IntegrityError for a malformed record."""
    _name, body = find_version(repo, ref)
    try:
        record = validate(body["record"])
        objects = [(o["kind"], o["id"], o["role"], o["manifest"]) for o in body["objects"]]
    except (KeyError, TypeError) as exc:
        raise IntegrityError(f"the version record of {ref} is malformed: {exc}") from exc
    return record, objects


def read_manifest(repo: Repository, kind: str, oid: str, name: str) -> Manifest:
    what = f"the manifest of {kind} {oid[:12]} (manifests/{name})"
    raw = repo.get_sealed(f"manifests/{name}", what)
    try:
        manifest = Manifest.from_bytes(zstandard.ZstdDecompressor().decompress(raw, max_output_size=MAX_MANIFEST),
                                       what)
    except (zstandard.ZstdError, HashcacheError) as exc:
        raise IntegrityError(f"{what} is malformed: {exc}") from exc
    if manifest.digest != oid:
        raise IntegrityError(f"{what} does not describe {kind} {oid[:12]}")
    return manifest


def fetch_blocks(repo: Repository, wanted: dict[bytes, Entry], accept: Callable[[bytes, bytes], None]) -> int:
    """Fetch and open every wanted blob, pack by pack, neighbours in one ranged GET; ``accept(id, block)``."""
    got = 0
    for r in ranges(wanted.items()):
        try:
            data = repo.client.get(repo.location.key(pack_name(r.pack)), r.start, r.length)
        except NotFound as exc:
            raise IntegrityError(f"pack {r.pack} is missing from the repository (`capsule repo check` names "
                                 "the versions that need it)") from exc
        got += len(data)
        for bid, block in open_range(repo.key, r, data, f"a block in pack {r.pack}").items():
            accept(bid, block)
    return got


def restore_object(store: Store, repo: Repository, index: dict[bytes, Entry], kind: str, oid: str, role: str,
                    name: str, report: RestoreReport) -> None:
    manifest = read_manifest(repo, kind, oid, name)
    places: dict[bytes, list[tuple[int, bytes]]] = defaultdict(list)
    for i, zero, block_hash in manifest.records():
        if not zero:
            places[repo.key.block_id(block_hash)].append((i, block_hash))
    missing = [bid for bid in places if bid not in index]
    if missing:
        raise IntegrityError(f"{kind} {oid[:12]}: {len(missing)} of its blocks are in no index of the repository "
                             "(`capsule repo check`)")
    shadow = open_shadow(store, kind, manifest, fresh=True)
    try:
        def accept(bid: bytes, block: bytes) -> None:
            for i, block_hash in places[bid]:
                if hash_block(block) != block_hash:
                    raise IntegrityError(f"{kind} {oid[:12]}: block {i} from the repository does not match its "
                                         "manifest hash")
            with translating_enospc(f"restoring {kind} {oid[:12]}"):
                shadow.write([(i, block) for i, _h in places[bid]])
            report.blocks += len(places[bid])

        todo = {bid: index[bid] for bid in places if not all(shadow.has(i) for i, _ in places[bid])}
        report.downloaded_bytes += fetch_blocks(repo, todo, accept)
        shadow.flush()
        install_received(store, kind, manifest, shadow, role=role)
    finally:
        shadow.close()
    store.index_object(object_path(store, kind, oid), manifest)
    report.installed.append(oid)


def restore(store: Store, ref: str, repo: Repository, progress: Callable[[str], None] = lambda _m: None
            ) -> RestoreReport:
    """Bring ``NAME[@V]`` from ``repo`` into ``store`` (only the objects the store lacks)."""
    t0 = time.monotonic()
    with repo.lock(reading=True) as lock:
        record, objects = version_body(repo, ref)
        report = RestoreReport(f"{record['capsule']}@{record['number']}", repo.location.url)
        index: dict[bytes, Entry] | None = None
        for kind, oid, role, name in objects:
            report.objects += 1
            if has_object(store, kind, oid):
                report.objects_present += 1
                continue
            if index is None:
                progress("reading the repository's indexes")
                index, _names = repo.load_index()
            progress(f"{role} {oid[:12]}")
            with suppress(Unreachable):     # a degraded store that refused the lock object refuses this too
                lock.refresh(if_due=True)
            restore_object(store, repo, index, kind, oid, role, name, report)
        _row, report.recorded = record_version(store, record)
    report.seconds = round(time.monotonic() - t0, 3)
    return report
