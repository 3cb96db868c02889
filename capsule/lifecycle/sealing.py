"""Sealing a running instance's leaves into a version: each non-empty leaf becomes a layer (compacted
first when asked), the version is recorded with its memory image in one transaction, and when sealing
fails after libvirt saved the guest, the guest comes back from its memory image on its own disks."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path

import libvirt

from capsule import qemuimg
from capsule.errors import CapsuleError
from capsule.lifecycle import compact as compact_mod
from capsule.lifecycle import demand, memimage
from capsule.runtime import saveimage
from capsule.store import Store
from capsule.store.catalogue import FileRow, InstanceRow, LayerRow, VersionRow

Say = Callable[[str], None]
Release = Callable[[int, Path, list[str]], Collection[int]]   # (disk index, leaf, chain) → blocks to drop


def seal_leaves(store: Store, inst: InstanceRow, say: Say, sealed: list[LayerRow] | None = None,
                 compacted: list[int] | None = None, release: Release | None = None,
                 released: list[int] | None = None) -> tuple[list[list[str]], list[LayerRow]]:
    """Seal every non-empty leaf; an untouched leaf is dropped and its chain
    kept. ``sealed`` collects each leaf's layer as soon as it is installed.
    With ``compacted`` (a list), leaves first lose the zero marks their chains already read as zero
    (``capsule.lifecycle.compact``), and the number dropped per leaf is appended to it; ``release(disk, leaf,
    chain)`` names blocks each leaf drops whatever they hold then (their count appended to ``released``)."""
    chains: list[list[str]] = []
    done: list[LayerRow] = [] if sealed is None else sealed
    for disk, (leaf_s, chain) in enumerate(zip(inst.leaves, inst.chains, strict=True)):
        leaf = Path(leaf_s)
        if demand.chain_needs_server(store, chain):
            demand.repoint_leaf(leaf, chain[-1])
        if compacted is not None:
            drop = release(disk, leaf, chain) if release is not None else ()
            done_c = compact_mod.compact_leaf(store, leaf, chain, drop)
            compacted.append(done_c.dropped)
            if released is not None:
                released.append(done_c.released)
            if done_c.dropped:
                say(f"{leaf.name}: {done_c.dropped} discarded blocks the parent already reads as zero dropped")
            if done_c.released:
                say(f"{leaf.name}: {done_c.released} blocks of dead content dropped (the parent's show through)")
        say(f"sealing {leaf.name}")
        row = store.seal_layer(leaf, chain[-1])
        done.append(row)
        if row.blocks == 0:
            chains.append(list(chain))
        else:
            chains.append([*chain, row.id])
    for row in done:
        if row.blocks == 0 and not any(row.id in c for c in chains):
            store.layer_path(row.id).unlink(missing_ok=True)
            store.layer_manifest_path(row.id).unlink(missing_ok=True)
    return chains, [r for r in done if r.blocks]


def record_sealed(store: Store, inst: InstanceRow, chains: list[list[str]], layers: list[LayerRow],
            memory: FileRow | None, note: str, balloon: dict | None = None) -> VersionRow:
    cat = store.catalogue
    base = cat.version(inst.capsule, inst.version)
    config = dict(base.config) if base else {}
    config.pop("balloon", None)
    if balloon:
        config["balloon"] = balloon  # so whoever restores this version gives the memory back
    with cat.transaction():
        number = cat.next_version_number(inst.capsule)
        version = VersionRow(capsule=inst.capsule, number=number, parent_capsule=inst.capsule,
                             parent_version=inst.version, memory=memory.id if memory else None,
                             chains=chains, config=config, note=note, created=time.time())
        for row in layers:
            cat.add_layer(row)
        if memory:
            cat.add_file(memory)
        cat.add_version(version)
        cat.delete_instance(inst.capsule)
    return version


def resume_after_failed_seal(store: Store, inst: InstanceRow, image: Path | None,
                              sealed: list[LayerRow]) -> None:
    """Sealing failed after libvirt saved the guest: bring the guest back from
    its memory image on its own disks (a leaf already sealed gets a fresh leaf
    on top), so the instance goes on as if the suspend had not been asked."""
    if image is None:
        return
    disks: list[Path] = []
    try:
        for i, leaf_s in enumerate(inst.leaves):
            leaf = Path(leaf_s)
            if not leaf.exists():
                if i >= len(sealed):
                    return
                leaf = store.new_leaf_path()
                qemuimg.create_leaf(leaf, store.layer_path(sealed[i].id))
            disks.append(leaf)
        header = saveimage.read_header(image)
        name, uuid = saveimage.identity(header.domain_xml, image.name)
        base = store.catalogue.version(inst.capsule, inst.version)
        if base is None:
            return
        chains = [[*c, sealed[i].id] if str(disks[i]) != inst.leaves[i] else c for i, c in enumerate(inst.chains)]
        memimage.restore(store, f"{inst.capsule}@{inst.version}", base.config, image, name=name, uuid=uuid,
                         disks=disks, instance_dir=Path(inst.dir),
                         disk_servers=demand.server_sockets(Path(inst.dir), [str(d) == leaf for d, leaf
                                                                              in zip(disks, inst.leaves, strict=True)]),
                         chains=chains)
        if [str(d) for d in disks] != inst.leaves:
            with store.catalogue.transaction():
                store.catalogue.delete_instance(inst.capsule)
                inst.leaves, inst.chains = [str(d) for d in disks], chains
                store.catalogue.add_instance(inst)
                for row in sealed:
                    store.catalogue.add_layer(row)
    except (libvirt.libvirtError, CapsuleError, OSError):
        return
    if image.parent == store.tmp_dir:
        image.unlink(missing_ok=True)
