"""A repository's upkeep: what it holds (``ls``, ``stats``), whether it is whole (``check``), dropping a
version (``forget``) and freeing what no version uses (``prune``, under the exclusive lock: restic's rule, so
no writer's packs are taken for garbage before its index is written)."""

from __future__ import annotations

import struct
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from capsule.errors import CapsuleError, IntegrityError, NotFound
from capsule.names import parse_ref
from capsule.repo.format import (
    Entry,
    PackWriter,
    Place,
    Range,
    blobs_of,
    encode_index,
    new_id,
    open_range,
    pack_name,
    read_pack_header,
)
from capsule.repo.repository import Repository
from capsule.repo.restore import read_manifest
from capsule.repo.uploads import Uploads
from hashcache.blocks import BLOCK_SIZE, hash_block


def listing(repo: Repository) -> list[dict[str, Any]]:
    out = []
    for name, body in repo.versions():
        rec = body["record"]
        out.append({"version": f"{rec['capsule']}@{rec['number']}", "record": name, "host": body.get("host"),
                    "pushed": body.get("pushed"), "created": rec.get("created"), "note": rec.get("note"),
                    "objects": len(body.get("objects", []))})
    return out


def _packs(repo: Repository) -> dict[str, int]:
    return {name.rsplit("/", 1)[1]: size for name, size in repo.names("packs")}


def _used(repo: Repository) -> tuple[dict[bytes, set[str]], dict[bytes, bytes], list[str], int]:
    """Block id → the versions using it, block id → its hash, problems with manifests, raw bytes referenced."""
    users: dict[bytes, set[str]] = defaultdict(set)
    hashes: dict[bytes, bytes] = {}
    problems: list[str] = []
    seen: set[str] = set()
    raw = 0
    for _name, body in repo.versions():
        version = f"{body['record']['capsule']}@{body['record']['number']}"
        for obj in body.get("objects", []):
            try:
                manifest = read_manifest(repo, obj["kind"], obj["id"], obj["manifest"])
            except (IntegrityError, NotFound) as exc:
                problems.append(f"{version}: {exc}")
                continue
            first = obj["manifest"] not in seen
            seen.add(obj["manifest"])
            for _i, zero, block_hash in manifest.records():
                if zero:
                    continue
                bid = repo.key.block_id(block_hash)
                users[bid].add(version)
                hashes[bid] = block_hash
                raw += BLOCK_SIZE if first else 0
    return users, hashes, problems, raw


def stats(repo: Repository) -> dict[str, Any]:
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for folder in ("packs", "index", "manifests", "versions", "keys", "locks"):
        for _name, size in repo.names(folder):
            totals[folder][0] += 1
            totals[folder][1] += size
    index, _ = repo.load_index()
    _users, _h, _p, raw = _used(repo)
    stored = sum(n for _c, n in totals.values())
    return {"url": repo.location.url, "format": repo.config.get("format"), "versions": totals["versions"][0],
            "packs": totals["packs"][0],
            "pack_bytes": totals["packs"][1], "indexes": totals["index"][0], "manifests": totals["manifests"][0],
            "keys": totals["keys"][0], "blocks": len(index), "stored_bytes": stored,
            "referenced_raw_bytes": raw, "dedup_ratio": round(raw / stored, 3) if stored else 0.0}


@dataclass
class CheckReport:
    url: str
    ok: bool = True
    versions: int = 0
    packs: int = 0
    blocks: int = 0
    read_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    bad_packs: dict[str, list[str]] = field(default_factory=dict)   # pack → the versions that use it

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def check(repo: Repository, *, read_data: bool = False) -> CheckReport:
    """Every version's manifests readable, every block they use indexed, every indexed pack present (and, with
    ``read_data``, every pack read whole: its header and each blob open, and each block hashes to its id)."""
    report = CheckReport(repo.location.url)
    with repo.lock(reading=True):
        try:
            index, _names = repo.load_index()
        except IntegrityError as exc:
            report.errors.append(str(exc))
            index = {}
        packs = _packs(repo)
        users, hashes, problems, _raw = _used(repo)
        report.errors += problems
        report.versions = sum(1 for _ in repo.names("versions"))
        report.packs, report.blocks = len(packs), len(index)
        by_pack: dict[str, dict[bytes, Entry]] = defaultdict(dict)
        for bid, entry in index.items():
            by_pack[entry.pack][bid] = entry
        unindexed = [bid for bid in users if bid not in index]
        if unindexed:
            versions = sorted({v for bid in unindexed for v in users[bid]})
            report.errors.append(f"{len(unindexed)} block(s) are in no index; versions: {', '.join(versions)}")

        def bad(pack: str, why: str) -> None:
            versions = sorted({v for bid in by_pack[pack] for v in users.get(bid, ())})
            report.bad_packs[pack] = versions
            report.errors.append(f"pack {pack} {why}; versions that use it: {', '.join(versions) or 'none'}")

        for pack in by_pack:
            if pack not in packs:
                bad(pack, "is missing")
            elif read_data:
                try:
                    data = repo.client.get(repo.location.key(pack_name(pack)))
                    report.read_bytes += len(data)
                    header = read_pack_header(repo.key, pack, data)
                    for bid, entry in by_pack[pack].items():
                        if header.get(bid) != entry.place:
                            raise IntegrityError(f"pack {pack}: its header and the index disagree")
                    whole = Range(pack, 0, len(data), tuple(by_pack[pack].items()))
                    for bid, block in open_range(repo.key, whole, data, f"a block in pack {pack}").items():
                        if bid in hashes and hash_block(block) != hashes[bid]:
                            raise IntegrityError(f"pack {pack}: a block does not match its hash")
                except (IntegrityError, struct.error) as exc:
                    bad(pack, f"is damaged ({exc})")
    report.ok = not report.errors
    return report


def forget(repo: Repository, ref: str) -> list[str]:
    """Drop the version records of ``NAME@V`` (``prune`` frees the blocks only it used)."""
    r = parse_ref(ref)
    if r.version is None:
        raise CapsuleError(f"say which version to forget: {r.name}@N")
    with repo.lock():
        names = [name for name, body in repo.versions()
                 if body["record"]["capsule"] == r.name and body["record"]["number"] == r.version]
        if not names:
            raise NotFound(f"the repository at {repo.location.url} holds no {ref}")
        for name in names:
            repo.client.delete(repo.location.key(name))
    return names


def prune(repo: Repository, *, dry_run: bool = False) -> dict[str, Any]:
    """Free what no version uses, alone in the repository: packs no used block is in are deleted, packs
    partly used are repacked (their used blobs copied, still sealed, into new packs); then one new index
    replaces the old ones, and only then are the old packs and indexes deleted (a prune that stops half-way
    leaves duplicates, never a hole). Unused manifests, packs in no index and stale locks go too."""
    out: dict[str, Any] = {"url": repo.location.url, "dry_run": dry_run, "packs_deleted": 0, "packs_repacked": 0,
                           "packs_written": 0, "bytes_freed": 0, "manifests_deleted": 0, "locks_deleted": 0}
    with repo.lock(exclusive=True):
        index, index_names = repo.load_index()
        users, _hashes, problems, _raw = _used(repo)
        if problems:
            raise IntegrityError("prune refused, the repository is damaged: " + "; ".join(problems[:3]))
        packs = _packs(repo)
        by_pack: dict[str, dict[bytes, Entry]] = defaultdict(dict)
        for bid, entry in index.items():
            by_pack[entry.pack][bid] = entry
        missing = [bid for bid in users if bid not in index or index[bid].pack not in packs]
        if missing:
            raise IntegrityError(f"prune refused: {len(missing)} used block(s) are missing (`capsule repo check`)")
        keep: dict[str, dict[bytes, Place]] = {}
        drop: list[str] = [p for p in packs if p not in by_pack]        # a dead writer's, never indexed
        repack: dict[str, list[tuple[tuple[int, int], dict[bytes, int]]]] = {}
        for pack, entries in by_pack.items():
            places = {bid: e.place for bid, e in entries.items()}
            blobs = blobs_of(places)
            used = [(at, members) for at, members in blobs.items() if any(bid in users for bid in members)]
            if len(used) == len(blobs):        # a blob is kept whole while any of its blocks is used
                keep[pack] = places
            else:
                drop.append(pack)
                if used:
                    repack[pack] = used
        out["packs_deleted"] = len(drop) - len(repack)
        out["packs_repacked"] = len(repack)
        out["bytes_freed"] = sum(packs.get(p, 0) for p in drop)
        if dry_run:
            return out
        writer = PackWriter(repo.key)

        def flush() -> None:
            nonlocal writer
            if len(writer):
                body = writer.finish()
                uploads.put(repo.location.key(pack_name(writer.id)), body)
                keep[writer.id] = dict(writer.entries)
                out["packs_written"] += 1
                out["bytes_freed"] -= len(body)
                writer = PackWriter(repo.key)

        with Uploads(repo.client) as uploads:      # the next old pack is read while the new ones go up
            for pack, used_blobs in repack.items():
                data = repo.client.get(repo.location.key(pack_name(pack)))
                for (off, n), members in used_blobs:
                    writer.add_sealed(members, data[off:off + n])
                    if writer.size >= repo.pack_size:
                        flush()
            flush()
            uploads.wait()                          # every new pack stored before an index names it
        if drop:
            repo.put_sealed(f"index/{new_id()}", encode_index(keep))
            for name in index_names:
                repo.client.delete(repo.location.key(name))
            for pack in drop:
                repo.client.delete(repo.location.key(pack_name(pack)))
        used_manifests = {o["manifest"] for _n, body in repo.versions() for o in body.get("objects", [])}
        for name in repo.manifest_names() - used_manifests:
            repo.client.delete(repo.location.key(f"manifests/{name}"))
            out["manifests_deleted"] += 1
        out["locks_deleted"] += len(repo.unlock())
    return out
