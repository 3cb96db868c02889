"""``--disk-only`` backups: the disks' state without a memory image, while the guest keeps running.

1. freeze the guest's file systems through the capsule agent (``fs.freeze``); a guest whose agent does
   not answer is not frozen: its backup is *crash-consistent* and recorded as such;
2. switch every disk to a fresh leaf on top of its current one, in one atomic libvirt external
   disk-only snapshot (the new leaves are made beforehand, named relative to the old ones);
3. thaw. The guest's file systems were frozen only for step 2: that is the pause reported;
4. seal each old leaf (now read-only under QEMU) into a layer, re-point the new leaf's header at the
   sealed layer's name (QMP ``change-backing-file``: QEMU writes its own open image's header), and record
   the new (inactive) version and the instance on its new leaves in one transaction.

If step 2 fails nothing changed (the new leaves are removed). If step 4 fails no version is recorded:
a disk whose old leaf was not sealed yet is committed back into it (a live block commit), one whose
old leaf was sealed stays on the new leaf over that layer (see ``_undo``)."""

from __future__ import annotations

import contextlib
import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libvirt
import libvirt_qemu

from capsule import qemuimg
from capsule.errors import Conflict, Error, RuntimeFailure
from capsule.lifecycle import USER_NETWORK
from capsule.runtime import guestaccess
from capsule.runtime.connection import lookup_domain
from capsule.runtime.guestagent import AgentError, AgentUnavailable, GuestAgent
from capsule.store import Store, claims
from capsule.store.catalogue import InstanceRow, LayerRow, VersionRow
from capsule.store.modes import LEAF_MODE

FREEZE_TIMEOUT = 10.0
COMMIT_TIMEOUT = 120.0
_FLAGS = (libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA
          | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_REUSE_EXT | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_ATOMIC)


@dataclass
class DiskSnapshot:
    version: VersionRow
    layers: list[LayerRow]
    pause: float            # seconds the file systems were frozen (or the switch took, unfrozen)
    consistency: str        # "frozen" or "crash-consistent"
    agent_error: str | None = None


def _targets(dom: libvirt.virDomain, leaves: list[str]) -> list[str]:
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


def _qmp(dom: libvirt.virDomain, cmd: str, **args: object) -> Any:   # QMP's reply: JSON
    reply = json.loads(libvirt_qemu.qemuMonitorCommand(dom, json.dumps({"execute": cmd, "arguments": args}), 0))
    if "error" in reply:
        raise RuntimeFailure(f"QEMU {cmd}: {reply['error'].get('desc', reply['error'])}")
    return reply.get("return")


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
    nodes = _qmp(dom, "query-named-block-nodes", flat=True)
    node = next((n["node-name"] for n in nodes if n.get("drv") == "qcow2" and _own_file(n) == str(leaf)), None)
    if node is None:
        raise RuntimeFailure(f"QEMU has no node for {leaf.name}")
    _qmp(dom, "change-backing-file", device=node, **{"image-node-name": node, "backing-file": backing})


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


def _freeze(sock: Path) -> tuple[GuestAgent | None, str | None]:
    try:
        agent = GuestAgent(sock, timeout=FREEZE_TIMEOUT)
    except AgentUnavailable as exc:
        return None, str(exc)
    try:
        agent.freeze(FREEZE_TIMEOUT)
    except (AgentUnavailable, AgentError) as exc:
        with contextlib.suppress(Error):
            agent.thaw()
        agent.close()
        return None, str(exc)
    return agent, None


def _thaw(agent: GuestAgent | None) -> None:
    if agent is None:
        return
    try:
        agent.thaw()
    finally:
        agent.close()


def snapshot(store: Store, name: str, note: Callable[[str], str]) -> DiskSnapshot:
    """Take a disk-only backup of running capsule ``name`` (see the module's description); ``note(consistency)``
    is the new version's note. The capsule is claimed ("being backed up") throughout; the guest's freeze and
    thaw are waited for without the store lock (the new leaves, made under it, are named in the claim, so gc
    keeps them until the instance records them)."""
    with claims.claim(store, name, "being backed up") as claim:
        inst, dom, targets, new = _prepare(store, name)
        claim.add_leaves(new)
        claims.check_unlocked(store, f"a disk-only backup of {name}")
        agent, agent_error = _freeze(Path(inst.dir) / "agent.sock")
        t0 = time.monotonic()
        try:
            dom.snapshotCreateXML(_snapshot_xml(targets, new), _FLAGS)
        except libvirt.libvirtError as exc:
            _thaw(agent)
            for p in new:
                p.unlink(missing_ok=True)
            raise RuntimeFailure(f"disk-only snapshot of {name} failed: {exc.get_error_message()}; "
                                 "the capsule runs on as before") from exc
        finally:
            pause = time.monotonic() - t0
        _thaw(agent)
        with store.lock(timeout=None, purpose=f"disk-only backup {name}"):   # the disks switched: record it
            return _record(store, inst, dom, targets, new, note, pause, agent, agent_error)


def _prepare(store: Store, name: str) -> tuple[InstanceRow, libvirt.virDomain, list[str], list[Path]]:
    """Under the store lock: the running instance, its disks' targets and a fresh leaf on each of its leaves."""
    with store.lock(purpose=f"disk-only backup {name}"):
        inst = store.catalogue.instance(name)
        dom = lookup_domain(inst.domain) if inst is not None else None
        if inst is None or dom is None:
            raise Conflict(f"capsule {name!r} is not running: a disk-only backup is of a running capsule")
        if (Path(inst.dir) / USER_NETWORK).exists():
            raise Conflict(f"{name} is running an update (`capsule update make`): its disks are half-way through "
                           "it; back it up when the update is done")
        targets = _targets(dom, inst.leaves)
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
            note: Callable[[str], str], pause: float, agent: GuestAgent | None,
            agent_error: str | None) -> DiskSnapshot:
    """Under the store lock, the disks switched: seal the old leaves, record the version and the instance on
    its new leaves (or put the disks back in order, ``_undo``)."""
    name, cat = inst.capsule, store.catalogue
    consistency = "frozen" if agent is not None else "crash-consistent"
    sealed: list[LayerRow] = []
    try:
        for leaf, chain, top in zip(inst.leaves, inst.chains, new, strict=True):
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
                                 note=note(consistency), created=time.time())
            for row in sealed:
                cat.add_layer(row)
            cat.add_version(version)
            cat.delete_instance(name)
            cat.add_instance(InstanceRow(capsule=name, version=version.number, domain=inst.domain,
                                         leaves=[str(p) for p in new], chains=chains, accel=inst.accel,
                                         dir=inst.dir, started=inst.started))
    except BaseException:
        _undo(store, dom, targets, inst, new, sealed)
        raise
    return DiskSnapshot(version, sealed, pause, consistency, agent_error)


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
        raise RuntimeFailure(f"a disk-only backup of {inst.capsule} failed and its disks could not be put "
                             f"back in order ({exc}); suspend or stop it to keep its state") from exc
