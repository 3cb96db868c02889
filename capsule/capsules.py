"""Capsules and their versions in the catalogue: create, derive, resolve, list."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsule import qemuimg
from capsule.bounds import VCPUS
from capsule.errors import AlreadyExists, InvalidName, NotFound
from capsule.names import check_name, parse_ref
from capsule.runtime.connection import lookup_domain
from capsule.store import Store
from capsule.store.catalogue import CapsuleRow, InstanceRow, LayerRow, VersionRow
from capsule.units import parse_memory_mib, parse_size

DEFAULT_MEMORY = "512M"


def resolve(store: Store, ref: str) -> VersionRow:
    """The version named by ``NAME`` (latest) or ``NAME@V``."""
    r = parse_ref(ref)
    if store.catalogue.capsule(r.name) is None:
        raise NotFound(f"no capsule named {r.name!r} in this store (see `capsule ls`)")
    v = (store.catalogue.latest_version(r.name) if r.version is None
         else store.catalogue.version(r.name, r.version))
    if v is None:
        raise NotFound(f"capsule {r.name!r} has no version {r.version}" if r.version
                       else f"capsule {r.name!r} has no versions")
    return v


def create(store: Store, name: str, image: str, memory: str = DEFAULT_MEMORY, cpus: int = 1,
           free_page_reporting: bool = True, data_disks: Sequence[str] = (), pod_network: bool = False
           ) -> VersionRow:
    """A new capsule whose system disk (disk 0, vda) is the image's root layer (shared, not copied), and one
    empty data disk (vdb, vdc, …) per size in ``data_disks``: a root layer without blocks, shared by every
    data disk of that size. ``pod_network``: the machine has a NIC on the host's pod bridge
    (``runtime.podnet``), so its pods share one network with the pods of the host's other such capsules."""
    check_name(name)
    check_name(image, "image")
    memory_mib = parse_memory_mib(memory)
    if not VCPUS.contains(cpus):
        raise InvalidName(f"--cpus {cpus} out of range: give {VCPUS.lo} to {VCPUS.hi}")
    sizes = [data_disk_size(s) for s in data_disks]
    if len(sizes) > MAX_DATA_DISKS:
        raise InvalidName(f"{len(sizes)} data disks: at most {MAX_DATA_DISKS}")
    with store.lock():
        cat = store.catalogue
        img = cat.image(image)
        if img is None:
            raise NotFound(f"no image named {image!r} (see `capsule image ls`, `capsule image build`)")
        if cat.capsule(name) is not None:
            raise AlreadyExists(f"a capsule named {name!r} already exists")
        now = time.time()
        config: dict[str, Any] = {
            "memory_mib": memory_mib,
            "vcpus": cpus,
            "kernel": img.kernel,
            "initrd": img.initrd,
            "cmdline": img.cmdline,
            "marker": img.marker,
            "image": img.name,
            "free_page_reporting": free_page_reporting,
        }
        if pod_network:
            config["pod_network"] = True
        empty = [_empty_layer(store, size) for size in sizes]
        version = VersionRow(capsule=name, number=1, parent_capsule=None, parent_version=None, memory=None,
                             chains=[[img.root_layer], *([row.id] for row in empty)], config=config,
                             note=f"created from image {image}" + (f" with {len(empty)} data disk(s)" if empty else ""),
                             created=now)
        with cat.transaction():
            for row in empty:
                cat.add_layer(row)
            cat.add_capsule(CapsuleRow(name, str(uuid.uuid4()), image, None, None, now))
            cat.add_version(version)
        return version


MAX_DATA_DISKS = 8
MAX_DATA_DISK = 16 << 40


def data_disk_size(text: str) -> int:
    """A data disk's size in bytes (``64M``, ``20G``), rounded up to a whole MiB."""
    size = parse_size(text)
    if not 1 << 20 <= size <= MAX_DATA_DISK:
        raise InvalidName(f"data disk size {text!r} out of range: give 1M to 16T")
    return -(-size // (1 << 20)) << 20


def _empty_layer(store: Store, size: int) -> LayerRow:
    """The sealed root layer of an empty disk of ``size`` bytes (named by its digest, like any layer: every
    empty disk of one size is the same object)."""
    tmp = store.new_leaf_path()
    try:
        qemuimg.create_empty(tmp, size)
        return store.seal_layer(tmp, None)
    finally:
        tmp.unlink(missing_ok=True)


def derive(store: Store, parent_ref: str, child: str, *, memory: bool = True, note: str | None = None) -> VersionRow:
    """A child capsule sharing all of the parent version's layers (and its memory image, unless
    ``memory`` is False: then the child boots from the parent's disks)."""
    check_name(child)
    with store.lock():
        parent = resolve(store, parent_ref)
        cat = store.catalogue
        if cat.capsule(child) is not None:
            raise AlreadyExists(f"a capsule named {child!r} already exists")
        now = time.time()
        pcap = cat.capsule(parent.capsule)
        config = dict(parent.config)
        if not memory:
            config.pop("balloon", None)  # only a restore of the memory image gives memory back
        version = VersionRow(capsule=child, number=1, parent_capsule=parent.capsule,
                             parent_version=parent.number, memory=parent.memory if memory else None,
                             chains=[list(c) for c in parent.chains], config=config,
                             note=note or f"derived from {parent.ref}", created=now)
        with cat.transaction():
            cat.add_capsule(CapsuleRow(child, str(uuid.uuid4()), pcap.image if pcap else None,
                                       parent.capsule, parent.number, now))
            cat.add_version(version)
        return version


@dataclass
class CapsuleState:
    name: str
    state: str             # running | arriving | suspended | stopped | crashed
    latest: VersionRow
    instance: InstanceRow | None


def state_of(store: Store, name: str) -> CapsuleState:
    latest = resolve(store, name)
    inst = store.catalogue.instance(name)
    if inst is not None:
        from capsule.exchange.incoming import MARK  # (the exchange builds on this module)

        if (Path(inst.dir) / MARK).exists():
            state = "arriving"     # a live move's destination: its guest is not running here yet
        else:
            state = "running" if lookup_domain(inst.domain) is not None else "crashed"
    else:
        state = "suspended" if latest.active else "stopped"
    return CapsuleState(name, state, latest, inst)


def list_states(store: Store) -> list[CapsuleState]:
    out = []
    for cap in store.catalogue.capsules():
        if store.catalogue.latest_version(cap.name) is not None:
            out.append(state_of(store, cap.name))
    return out
