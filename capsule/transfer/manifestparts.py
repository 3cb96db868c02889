"""A pushed object's manifest, part by part (``POST /v1/recv/KIND/ID/begin``), and its *like*.

A part is zstd of its records (an Expectation's bytes: a key and an 8-byte hash prefix a block, 16 bytes of
which the prefix does not compress: a 256 MiB memory image's manifest is about 0.25 MB on the wire). A memory
image is mostly what the capsule's older memory image held at the same places, so where the receiver holds one
(its *like*: the nearest other version's that the receiver answers it has, ``POST /v1/objects/missing``) a
part is compressed against that image's records of the same blocks (``hashcache.hcp.like_records``), which
the receiver makes the same way: the records that did not change cost a few bytes a run of them. The receiver
checks the part as any (its records, then the object's digest at the end); a like it no longer holds, or may
not read, answers Conflict, and the parts go plain from there. Only to an agent that names ``manifest-like``.

A pull asks the same of READ-HASH (``?like=FILE``: the memory image of the nearest other version this store
holds, :func:`held_like`); an agent that holds it too (and lets the caller read it) answers against its records
of the chunk's blocks and says which (``X-Capsule-Like-Span: FIRST-LAST``, :func:`span_dictionary`), one that
does not (or an older one) answers plain."""

from __future__ import annotations

from typing import Any

import zstandard

from capsule.agentclient import AgentClient
from capsule.errors import Conflict
from capsule.store import Store
from capsule.store.objectio import has_object, object_manifest
from hashcache.hcp import Expectation, ProtocolError, compress_like, like_records
from hashcache.manifest import Manifest
from hashcache.transport.base import Reply

LIKE_FEATURE = "manifest-like"
CANDIDATES = 8          # older memory images asked about, the nearest versions first


def like_candidates(store: Store, capsule: str, number: int, memory: str | None) -> list[str]:
    """The memory images of ``capsule``'s other versions, the nearest to ``number`` first: what to ask the
    receiver about for the memory image ``memory`` of version ``number``."""
    if not memory:
        return []
    others = sorted((v for v in store.catalogue.versions(capsule) if v.memory and v.memory != memory),
                    key=lambda v: (abs(v.number - number), -v.number))
    return list(dict.fromkeys(v.memory for v in others if v.memory))[:CANDIDATES]


def held_like(store: Store, record: dict[str, Any]) -> str | None:
    """For a version ``record`` this store fetches: the memory image of the nearest other version of its capsule
    that this store holds (the *like* its memory image's records are asked against), or None."""
    candidates = like_candidates(store, str(record.get("capsule")), int(record.get("number") or 0),
                                 record.get("memory"))
    return next((c for c in candidates if has_object(store, "file", c)), None)


def span_dictionary(like: Manifest, span: str | None, hash_len: int, block_count: int) -> bytes | None:
    """What a READ-HASH answer was compressed against, from its span header (a peer's: checked); None if the
    answer is plain."""
    if span is None:
        return None
    first, _, last = span.partition("-")
    if not (first.isdigit() and last.isdigit() and int(first) <= int(last) < block_count):
        raise ProtocolError(f"a malformed like span {span[:40]!r} for an object of {block_count} blocks")
    return like_records(like, int(first), int(last), hash_len)


class PartSender:
    """Sends one object's manifest parts, against ``like`` (a file id the receiver holds) while it can."""

    def __init__(self, store: Store, client: AgentClient, kind: str, oid: str, hash_len: int, *,
                 lookup: bool = True, like: str | None = None) -> None:
        self.client, self.kind, self.oid, self.hash_len, self.lookup = client, kind, oid, hash_len, lookup
        self.like_id = like if like and LIKE_FEATURE in client.features else None
        self.like: Manifest | None = object_manifest(store, "file", self.like_id) if self.like_id else None
        self.liked = 0          # parts sent against the like

    def begin(self, part: Expectation, k: int, parts: int) -> Reply:
        raw = part.to_bytes()
        params: dict[str, Any] = {"hash": str(self.lookup).lower(), "part": k, "parts": parts}
        path = f"/v1/recv/{self.kind}/{self.oid}/begin"
        if self.like is not None and len(part):
            first, last = part.keys[0] >> 1, part.keys[-1] >> 1
            records = like_records(self.like, first, last, self.hash_len)
            if records:
                try:
                    resp = self.client.request(
                        "POST", path, content=compress_like(raw, records), idempotent=True,
                        params={**params, "like": self.like_id, "like_first": first, "like_last": last,
                                "like_len": self.hash_len})
                    self.liked += 1
                    return resp
                except Conflict:
                    self.like = None        # not held there any more: plain parts from here
        return self.client.request("POST", path, content=zstandard.ZstdCompressor(level=3).compress(raw),
                                   params=params, idempotent=True)   # a part sent again is taken as the same
