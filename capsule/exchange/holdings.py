"""What a pusher may learn is held here: only blocks of objects its grant may read.

A push's receiver answers ``begin`` with the blocks it still needs (the others it has in its hash cache) and
rebuilds delta uploads against the pushed layer's parent. Both answers say something about what this host
holds, so a grant (:mod:`capsule.accounts.grants`) gets them only about the objects it may read
(:func:`capsule.accounts.grants.readable`): a block held only in another capsule's objects is asked for again
(it costs bytes, it leaks nothing), and a parent outside them is refused. A user's token (operators and
admins: the whole host) keeps every holding.

The hash cache cannot answer "held in these objects": it keeps one place per hash, whichever object was indexed
last. So the blocks a grant may read are the hash prefixes of its objects' manifests, one sorted ``array('Q')``
per object (8 bytes a block; objects never change, so each is read once and kept, LRU, up to
:data:`MAX_ENTRIES` prefixes), merged once per set of objects held. A prefix outside them is not looked up at
all, so neither the answer nor its time depends on another capsule's blocks."""

from __future__ import annotations

import bisect
import heapq
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from capsule.accounts import grants
from capsule.accounts.model import Grant
from capsule.errors import Forbidden
from capsule.store import Store
from capsule.store.objectio import has_object
from hashcache.hcp import BlockLookup
from hashcache.manifest import RECORD_SIZE

MAX_ENTRIES = 32 << 20      # hash prefixes kept per object, and again merged per set (256 MiB each): 128 GiB
MAX_SCOPES = 8              # merged sets of objects kept


def _prefix(digest: bytes) -> int:
    """The first 8 bytes of a hash (or a hash prefix), as the manifests' index holds them."""
    return int.from_bytes(digest[:8], sys.byteorder)


def _prefixes_of(record_bytes: bytes) -> array[int]:
    """The sorted first 8 bytes of every record's hash (a record: u64 key, 32-byte hash)."""
    words = memoryview(record_bytes).cast("Q")
    return array("Q", sorted(words[1::RECORD_SIZE // 8]))


class _Index:
    """Sorted hash prefixes per object and per set of objects, shared by request threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: OrderedDict[tuple[str, str, str], array[int]] = OrderedDict()
        self._scopes: OrderedDict[tuple[str, frozenset[tuple[str, str]]], array[int]] = OrderedDict()
        self._entries = 0
        self._scope_entries = 0

    def _object(self, store: Store, kind: str, oid: str) -> array[int]:
        key = (str(store.home), kind, oid)
        with self._lock:
            found = self._objects.get(key)
            if found is not None:
                self._objects.move_to_end(key)
                return found
        m = store.layer_manifest(oid) if kind == "layer" else store.file_manifest(oid)
        prefixes = _prefixes_of(m.record_bytes)
        with self._lock:
            if key not in self._objects:
                self._objects[key] = prefixes
                self._entries += len(prefixes)
            while self._entries > MAX_ENTRIES and len(self._objects) > 1:
                _k, old = self._objects.popitem(last=False)
                self._entries -= len(old)
        return prefixes

    def of(self, store: Store, objects: frozenset[tuple[str, str]]) -> array[int]:
        key = (str(store.home), objects)
        with self._lock:
            found = self._scopes.get(key)
            if found is not None:
                self._scopes.move_to_end(key)
                return found
        parts = [self._object(store, kind, oid) for kind, oid in sorted(objects)]
        merged = parts[0] if len(parts) == 1 else array("Q", heapq.merge(*parts))    # no list of them all
        with self._lock:
            if key not in self._scopes:
                self._scopes[key] = merged
                self._scope_entries += len(merged)
            while len(self._scopes) > 1 and (len(self._scopes) > MAX_SCOPES or self._scope_entries > MAX_ENTRIES):
                _k, old = self._scopes.popitem(last=False)
                self._scope_entries -= len(old)
        return merged


_index = _Index()


def held_readable(store: Store, g: Grant) -> frozenset[tuple[str, str]]:
    """The objects ``g`` may read that are held here now, as (kind, id)."""
    layers, files = grants.readable(store, g)
    return frozenset([("layer", lid) for lid in layers if has_object(store, "layer", lid)]
                     + [("file", fid) for fid in files if has_object(store, "file", fid)])


def readable_file(store: Store, g: Grant | None, fid: str) -> bool:
    """Whether file ``fid`` is held here and ``g`` may read it (None: a user's token, every object)."""
    if not has_object(store, "file", fid):
        return False
    return g is None or fid in grants.readable(store, g)[1]


def check_parent(store: Store, g: Grant | None, name: str, parent: str) -> None:
    """Refuse (:class:`Forbidden`) a layer whose manifest names a parent ``g`` may not read: deltas are rebuilt
    against it, and whether it is held here would be told."""
    if g is None:
        return
    layers, _files = grants.readable(store, g)
    if parent not in layers:
        raise Forbidden(f"{name}: its manifest names the parent layer {parent[:12]}, which is not an object this "
                        f"grant ({g.describe()}) may read; a pushed layer's parent is a layer of the version it "
                        "pushes (its record's chains)")


class ScopedLookup:
    """A hash cache seen through a grant: a hash outside the blocks of the objects it may read is a miss, and is
    never looked up."""

    def __init__(self, cache: BlockLookup, allowed: array[int]) -> None:
        self.cache = cache
        self.allowed = allowed

    def _may(self, digest: bytes) -> bool:
        p = _prefix(digest)
        i = bisect.bisect_left(self.allowed, p)
        return i < len(self.allowed) and self.allowed[i] == p

    def lookup(self, digest: bytes) -> bytes | None:
        return self.cache.lookup(digest) if self._may(digest) else None

    def lookup_prefix(self, prefix: bytes) -> tuple[bytes, bytes] | None:
        return self.cache.lookup_prefix(prefix) if self._may(prefix) else None

    def lookup_prefix_many(self, prefixes: Sequence[bytes]) -> list[tuple[bytes, bytes] | None]:
        may = [self._may(p) for p in prefixes]
        asked = [p for p, ok in zip(prefixes, may, strict=True) if ok]
        many = getattr(self.cache, "lookup_prefix_many", None)
        found = iter(many(asked) if many is not None else [self.cache.lookup_prefix(p) for p in asked])
        return [next(found) if ok else None for ok in may]


def lookup_for(store: Store, g: Grant | None) -> BlockLookup:
    """This host's hash cache as ``g`` may see it (None: a user's token, the whole cache)."""
    cache = store.hash_cache()
    if g is None:
        return cache
    objects = held_readable(store, g)
    return ScopedLookup(cache, _index.of(store, objects) if objects else array("Q"))
