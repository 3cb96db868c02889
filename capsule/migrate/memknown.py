"""The blocks a live move's memory codec (:mod:`ramdedup`) may name: :class:`Known`, the hashes of the objects both
hosts hold, and where each block is in them (the object, numbered as the move names its objects, and the block)."""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable

from capsule.migrate.memdelta import Similar
from hashcache.manifest import Manifest

Objects = list[tuple[str, str]]    # (kind, id) of objects whose blocks a reference may name: "layer" or "file"


class Known:
    """The hashes of blocks the destination holds, as a sorted array of their first 8 bytes (8 bytes each; a
    false positive, about n·m/2⁶⁴ over a move, costs a failed move, never a wrong page). Made from the objects'
    manifests (:meth:`of_manifests`), it also knows where each block is: :meth:`place` (8 bytes more each)."""

    def __init__(self, prefixes: Iterable[int] = ()) -> None:
        self._keys = array("Q", sorted(set(prefixes)))
        self._places = array("Q")                 # (object << 32 | record), parallel to _keys; empty: no places
        self._manifests: list[Manifest] = []
        self.similar: Similar | None = None       # blocks held in memory a page may be a delta against

    @classmethod
    def of_manifests(cls, manifests: Iterable[Manifest]) -> Known:
        known = cls()
        keys, places = array("Q"), array("Q")
        for n, m in enumerate(manifests):
            known._manifests.append(m)
            view = memoryview(m.record_bytes).cast("Q")   # each record: u64 key, then the hash
            for pos, (key, prefix) in enumerate(zip(view[0::5], view[1::5], strict=True)):
                if not key & 1:                            # zero blocks carry no hash
                    keys.append(prefix)
                    places.append(n << 32 | pos)
        order = sorted(range(len(keys)), key=keys.__getitem__)
        known._keys = array("Q", (keys[i] for i in order))
        known._places = array("Q", (places[i] for i in order))
        return known

    def __contains__(self, h: bytes) -> bool:
        k = int.from_bytes(h[:8], sys.byteorder)
        i = bisect_left(self._keys, k)
        return i < len(self._keys) and self._keys[i] == k

    def place(self, h: bytes, prefer: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """Where a block of hash ``h`` is: (object number, block index), its whole hash checked against the
        object's manifest; ``prefer``, where there are several (the next block of a run); None if nowhere."""
        k = int.from_bytes(h[:8], sys.byteorder)
        i = bisect_left(self._keys, k)
        found = None
        while i < len(self._places) and self._keys[i] == k:
            obj, pos = self._places[i] >> 32, self._places[i] & 0xFFFF_FFFF
            record = self._manifests[obj].record_range(pos, 1)
            if record[8:] == h:
                here = (obj, int.from_bytes(record[:8], "little") >> 1)
                if prefer is None or here == prefer:
                    return here
                found = found or here
            i += 1
        return found

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        return len(self._keys) * self._keys.itemsize + len(self._places) * self._places.itemsize
