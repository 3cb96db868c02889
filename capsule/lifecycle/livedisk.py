"""A running capsule's disks sealed into a version without stopping it: each disk switches to a fresh leaf
on top of its current one in one atomic libvirt external disk-only snapshot (the guest stops for tens of
milliseconds), then each old leaf (read-only under QEMU from then on) is sealed into a layer, the new leaf's
header re-pointed at the sealed layer's name (QMP ``change-backing-file``: QEMU writes its own open image's
header), and the new (inactive) version and the instance on its new leaves are recorded in one transaction.

Used by a live move (its disks at T0, ``capsule.migrate.live``) and by disk-only backups
(``capsule.backup.diskonly``, which freezes the guest's file systems around the switch: ``hold``).

If the switch fails nothing changed (the new leaves are removed). If sealing fails no version is recorded:
a disk whose old leaf was not sealed yet is committed back into it (a live block commit), one whose old leaf
was sealed stays on the new leaf over that layer (see ``_undo``)."""

from __future__ import annotations

import contextlib
import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import libvirt

from capsule import qemuimg
from capsule.errors import Conflict, Error, RuntimeFailure
from capsule.lifecycle.instances import USER_NETWORK
from capsule.runtime import guestaccess, qmp
from capsule.runtime.connection import lookup_domain
from capsule.store import Store, claims
from capsule.store.catalogue import InstanceRow, LayerRow, VersionRow
from capsule.store.modes import LEAF_MODE

COMMIT_TIMEOUT = 120.0
FLAGS = (libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA
         | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_REUSE_EXT | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_ATOMIC)
Hold = Callable[[InstanceRow], Callable[[], None]]   # before the switch: what to do, and its undo after it


@dataclass
class DisksSealed:
    version: VersionRow          # the new inactive version: the disks as they were at the switch
    layers: list[LayerRow]
    instance: InstanceRow        # the instance, running on its new leaves over the version's layers
    pause: float                 # seconds the switch took (with ``hold``: from the hold to its undo)


def _nothing(_inst: InstanceRow) -> Callable[[], None]:
    return lambda: None


def seal_disks_running(store: Store, name: str, note: str | Callable[[], str], *, hold: Hold = _nothing,
                       doing: str = "sealing its disks") -> DisksSealed:
    """Seal the disks of running capsule ``name`` into a new version while it runs on (see the module's
    text); ``note`` (or ``note()`` once the switch is made) is the version's note. The capsule is claimed
    (``doing``) throughout; ``hold(instance)`` runs before the switch without the store lock, and what it
    returns right after it. The new leaves, made under the lock, are named in the claim (gc keeps them)."""
    with claims.claim(store, name, doing) as claim:
        inst, dom, targets, new = _prepare(store, name, doing)
        claim.add_leaves(new)
        claims.check_unlocked(store, f"{doing} ({name})")
        release = hold(inst)
        t0 = time.monotonic()
        try:
            dom.snapshotCreateXML(_snapshot_xml(targets, new), FLAGS)
        except libvirt.libvirtError as exc:
            release()
            for p in new:
                p.unlink(missing_ok=True)
            raise RuntimeFailure(f"the disk-only snapshot of {name} failed: {exc.get_error_message()}; "
                                 "the capsule runs on as before") from exc
        finally:
            pause = time.monotonic() - t0
        release()
        text = note if isinstance(note, str) else note()
        with store.lock(timeout=None, purpose=f"{doing} ({name})"):   # the disks switched: record it
            version, layers, inst2 = _record(store, inst, dom, targets, new, text)
        return DisksSealed(version, layers, inst2, pause)


def targets_of(dom: libvirt.virDomain, leaves: list[str]) -> list[str]:
    """The guest's device name (vda …) of each leaf, in the instance's order."""
    root = ET.fromstring(dom.XMLDesc(0))
    by_file: dict[str, str] = {}
    for disk in root.findall("./devices/disk"):
        src, tgt = disk.find("source"), disk.find("target")
        file = src.get("file") if src is not None else None
        dev = tgt.get("dev") if tgt is not None else None   # (libvirt's schema requires a target's dev)
        if file and dev is not None:
            by_file[file] = dev
    missing = [leaf for leaf in leaves if leaf not in by_file]
    if missing:
        raise Conflict(f"the running domain does not use the instance's leaves ({', '.join(missing)}); "
                       "stop and start the capsule")
    return [by_file[leaf] for leaf in leaves]


def _snapshot_xml(targets: list[str], new: list[Path]) -> str:
    disks = "".join(f"<disk name='{t}' snapshot='external' type='file'><source file='{p}'/>"
                    f"<driver type='qcow2'/></disk>" for t, p in zip(targets, new, strict=True))
    return f"<domainsnapshot><disks>{disks}</disks></domainsnapshot>"


def _own_file(node: dict) -> str | None:
    """The file a qcow2 node reads: its ``file`` name, or in a ``json:`` description the file child's."""
    name = node.get("file") or ""
    if not name.startswith("json:"):
        return name
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return json.loads(name[5:])["file"]["filename"]
    return None


def _repoint(dom: libvirt.virDomain, leaf: Path, backing: str) -> None:
    """Set the backing file name in the header of ``leaf``, which QEMU has open as a disk's top."""
    nodes = qmp.command(dom, "query-named-block-nodes", flat=True)
    assert isinstance(nodes, list)
    node = next((n["node-name"] for n in nodes if n.get("drv") == "qcow2" and _own_file(n) == str(leaf)), None)
    if node is None:
        raise RuntimeFailure(f"QEMU has no node for {leaf.name}")
    qmp.command(dom, "change-backing-file", device=node, **{"image-node-name": node, "backing-file": backing})


def _commit_back(store: Store, dom: libvirt.virDomain, target: str, old_leaf: Path) -> None:
    """Undo the switch of one disk: merge its new leaf into ``old_leaf`` (the private leaf right below it,
    named explicitly: a commit must never reach a sealed layer further down) and make that active again."""
    if not old_leaf.name.startswith("leaf-") or old_leaf.parent != store.layers_dir or not old_leaf.exists():
        raise RuntimeFailure(f"{old_leaf} is not this instance's private leaf: not committing into it")
    store.assert_mutable(old_leaf)
    old_leaf.chmod(LEAF_MODE)        # a seal that failed between its chmod and its rename left it read-only
    flags = libvirt.VIR_DOMAIN_BLOCK_COMMIT_ACTIVE | libvirt.VIR_DOMAIN_BLOCK_COMMIT_SHALLOW
    dom.blockCommit(target, str(old_leaf), None, 0, flags)
    deadline = time.monotonic() + COMMIT_TIMEOUT
    while True:
        # cur == end is not enough (it also holds for a job that has not counted yet): the pivot is
        # refused until QEMU says the job is ready, so it is tried until it takes
        info = dom.blockJobInfo(target, 0)
        if not info:
            raise RuntimeFailure(f"committing {target} back stopped before it could be made active")
        if info.get("cur") == info.get("end"):
            try:
                dom.blockJobAbort(target, libvirt.VIR_DOMAIN_BLOCK_JOB_ABORT_PIVOT)
                return
            except libvirt.libvirtError as exc:
                if "not ready" not in str(exc):
                    raise
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"committing {target} back did not finish in {COMMIT_TIMEOUT:.0f}s")
        time.sleep(0.1)


def _prepare(store: Store, name: str, doing: str) -> tuple[InstanceRow, libvirt.virDomain, list[str], list[Path]]:
    """Under the store lock: the running instance, its disks' targets and a fresh leaf on each of its leaves."""
    with store.lock(purpose=f"{doing} ({name})"):
        inst = store.catalogue.instance(name)
        dom = lookup_domain(inst.domain) if inst is not None else None
        if inst is None or dom is None:
            raise Conflict(f"capsule {name!r} is not running (`capsule start {name}`)")
        if (Path(inst.dir) / USER_NETWORK).exists():
            raise Conflict(f"{name} is running an update (`capsule update make`): its disks are half-way through "
                           "it; try again when the update is done")
        targets = targets_of(dom, inst.leaves)
        new: list[Path] = []
        try:
            for leaf in inst.leaves:
                path = store.new_leaf_path()
                qemuimg.create_leaf(path, Path(leaf))
                new.append(path)
                guestaccess.lend(path, writable=True)   # QEMU switches to it and writes it
        except BaseException:
            for p in new:
                p.unlink(missing_ok=True)
            raise
        return inst, dom, targets, new


def _record(store: Store, inst: InstanceRow, dom: libvirt.virDomain, targets: list[str], new: list[Path],
            note: str) -> tuple[VersionRow, list[LayerRow], InstanceRow]:
    """Under the store lock, the disks switched: seal the old leaves, record the version and the instance on
    its new leaves (or put the disks back in order, ``_undo``)."""
    name, cat = inst.capsule, store.catalogue
    sealed: list[LayerRow] = []
    try:
        for leaf, top in zip(inst.leaves, new, strict=True):
            chain = inst.chains[len(sealed)]
            row = store.seal_layer(Path(leaf), chain[-1])
            sealed.append(row)
            _repoint(dom, top, store.layer_path(row.id).name)
        base = cat.version(name, inst.version)
        config = dict(base.config) if base else {}
        config.pop("balloon", None)
        chains = [[*chain, row.id] for chain, row in zip(inst.chains, sealed, strict=True)]
        with cat.transaction():
            version = VersionRow(capsule=name, number=cat.next_version_number(name), parent_capsule=name,
                                 parent_version=inst.version, memory=None, chains=chains, config=config,
                                 note=note, created=time.time())
            for row in sealed:
                cat.add_layer(row)
            cat.add_version(version)
            cat.delete_instance(name)
            now = InstanceRow(capsule=name, version=version.number, domain=inst.domain,
                              leaves=[str(p) for p in new], chains=chains, accel=inst.accel,
                              dir=inst.dir, started=inst.started)
            cat.add_instance(now)
    except BaseException:
        _undo(store, dom, targets, inst, new, sealed)
        raise
    return version, sealed, now


def _undo(store: Store, dom: libvirt.virDomain, targets: list[str], inst: InstanceRow, new: list[Path],
          sealed: list[LayerRow]) -> None:
    """Sealing failed after the switch: a disk whose old leaf was sealed stays on its new leaf over that
    layer (rolled forward: the layer is recorded, the header re-pointed); a disk whose old leaf was not is
    committed back into it (rolled back). The instance row says which; no version is recorded."""
    leaves, chains = list(inst.leaves), [list(c) for c in inst.chains]
    try:
        for i, target in enumerate(targets):
            if i < len(sealed):
                _repoint(dom, new[i], store.layer_path(sealed[i].id).name)
                leaves[i], chains[i] = str(new[i]), [*chains[i], sealed[i].id]
            else:
                _commit_back(store, dom, target, Path(inst.leaves[i]))
                new[i].unlink(missing_ok=True)
        cat = store.catalogue
        with cat.transaction():
            for row in sealed:
                cat.add_layer(row)
            cat.delete_instance(inst.capsule)
            cat.add_instance(InstanceRow(capsule=inst.capsule, version=inst.version, domain=inst.domain,
                                         leaves=leaves, chains=chains, accel=inst.accel, dir=inst.dir,
                                         started=inst.started))
    except (libvirt.libvirtError, Error, OSError) as exc:
        raise RuntimeFailure(f"sealing the disks of running {inst.capsule} failed and they could not be put "
                             f"back in order ({exc}); suspend or stop it to keep its state") from exc
