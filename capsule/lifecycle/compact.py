"""Dropping a leaf's zero marks that change nothing, before it is sealed.

A guest that discards blocks (``fstrim``, virtio discard) makes QEMU mark the whole 128 KiB clusters as
*zero* in its leaf, since the backing chain must no longer show through. After a full ``fstrim`` that is
every free cluster of the file system, almost all of them already zero in the chain below (never written
since ``mkfs``): sealed as they are they would list hundreds of thousands of zero blocks in the layer's
manifest (40 bytes each, and on the wire with every transfer). Here the leaf is rewritten without the
zero marks the chain already reads as zero; what the guest reads is unchanged block for block. Zero
marks over blocks the chain holds data in stay: they are the discard's real effect, and cost no data."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from capsule.lifecycle import demand
from capsule.store import Store
from hashcache.blocks import BLOCK_SIZE
from hashcache.manifest import Manifest, manifest_of_layer
from hashcache.qcow2 import Qcow2Image
from hashcache.qcow2_writer import write_layer


@dataclass
class Compacted:
    zero_before: int      # zero-marked blocks in the leaf
    dropped: int          # of which the chain below already read as zero (gone now)
    released: int = 0     # blocks the caller asked to drop whatever they held (``drop``), gone now

    @property
    def zero_after(self) -> int:
        return self.zero_before - self.dropped


def chain_nonzero(manifests: list[Manifest], blocks: int) -> bytearray:
    """Per block, 1 if the chain (root first) reads data there, 0 if it reads zero (or nothing: a block
    no layer defines reads as zero)."""
    out = bytearray(blocks)
    for manifest in manifests:
        for index, zero, _hash in manifest.records():
            if index < blocks:
                out[index] = 0 if zero else 1
    return out


def drop_covered_zeros(leaf: Path, chain: list[str], manifest_of: Callable[[str], Manifest],
                       drop: Collection[int] = ()) -> Compacted:
    """Rewrite ``leaf`` (whose backing is ``chain[-1]``; ``manifest_of(layer_id)`` gives each layer's
    manifest) without the zero marks ``chain`` already reads as zero, and without any record (data or
    zero mark) of the blocks in ``drop``: those read as the chain below again (the caller knows their
    content is dead, e.g. ``capsule.update.journal``). Nothing is written when nothing goes."""
    mode = os.stat(leaf).st_mode & 0o777
    with Qcow2Image(leaf) as img:
        backing = img.backing_file
        size = img.virtual_size
    own = manifest_of_layer(leaf, chain[-1] if chain else None)
    blocks = -(-size // BLOCK_SIZE)
    zero_before = own.zero_blocks
    drop = frozenset(drop)
    released = sum(1 for i, _z, _h in own.records() if i in drop) if drop else 0
    if not zero_before and not released:
        return Compacted(0, 0)
    below = chain_nonzero([manifest_of(lid) for lid in chain], blocks) if zero_before else bytearray(blocks)
    keep = [(i, z) for i, z, _h in own.records() if i not in drop and (not z or below[i])]
    dropped = len(own) - len(keep) - released
    if not dropped and not released:
        return Compacted(zero_before, 0)
    tmp = leaf.with_name(leaf.name + ".compact")
    try:
        with Qcow2Image(leaf) as img:
            def read_block(index: int) -> bytes:
                data = img.read_block(index)
                if data is None:  # the manifest said data: the leaf changed under us
                    raise OSError(f"{leaf.name}: block {index} vanished while it was compacted")
                return data

            write_layer(tmp, virtual_size=size, backing=backing, records=keep, read_block=read_block)
        os.chmod(tmp, mode)
        os.replace(tmp, leaf)
    finally:
        tmp.unlink(missing_ok=True)
    return Compacted(zero_before, dropped, released)


def compact_leaf(store: Store, leaf: Path, chain: list[str], drop: Collection[int] = ()) -> Compacted:
    """``drop_covered_zeros`` for an instance's leaf over ``chain``, a chain of this store (local or remote
    layers: a remote layer's manifest is here too); ``drop``: blocks to drop whatever they hold."""
    def manifest_of(layer_id: str) -> Manifest:
        if demand.is_remote(store, layer_id):
            return Manifest.read(demand.remote_manifest_path(store, layer_id))
        return store.layer_manifest(layer_id)

    return drop_covered_zeros(leaf, chain, manifest_of, drop)
