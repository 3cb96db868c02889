"""The destination side of a live move (``capsule migrate NAME --to HOST``, :mod:`capsule.migrate.live`).

    POST /v1/live/check                 {capsule, type, cpu, host}: why this host would refuse it
                                        → {refusals, postcopy, host}
    POST /v1/live/prepare               {capsule, version, xml, disks, tunnel}: an instance ready to receive it
    POST /v1/live/{id}/finish           the guest arrived and runs: it is this host's running instance
    POST /v1/live/{id}/abort            the move stopped: what prepare made is removed
    POST /v1/live/{id}/recover          its post-copy lost its link: QEMU here listens again to resume it

``prepare`` makes the instance directory and an empty qcow2 leaf over each of the version's disks (the
version was pushed first) at this store's own paths, records the instance (so ``start`` and gc leave it
alone) with a ``incoming.json`` naming the move, and answers the domain XML the guest is to run with here:
built from this host's template and the version's config exactly as a memory image is restored
(:func:`capsule.runtime.restorexml.rebuild`): from the source's XML only what the running machine's state
requires is kept, allow-listed, and no path of the source is ever used.

The streams (libvirtd to libvirtd, QEMU's migration stream, the disks' NBD) cross in the agents' byte tunnel
(:mod:`capsule.exchange.tunnel`), never on a port of their own: ``prepare`` names the tunnel session the source
opened (``tunnel``), and when that session ends (closed or expired) with the move still unfinished, what prepare
made is removed (:func:`ended`); so is every unfinished move when the agent starts (:func:`sweep`: its source's
streams went with the agent that carried them).

``host`` (libvirt's host UUID at the source): equal to this host's, the destination is the source's own libvirt
(two agents on one machine): refused as ``same_host``, a live move needs another host."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import libvirt

from capsule import qemuimg
from capsule.bounds import VERSION, Bound, check
from capsule.errors import Conflict, Error, InvalidName, NotFound, RuntimeFailure
from capsule.lifecycle import memimage
from capsule.names import check_name
from capsule.runtime import qmp, restorexml
from capsule.runtime.connection import connect, host_uuid, lookup_domain, postcopy_failed, state_of
from capsule.store import Store, claims
from capsule.store.catalogue import InstanceRow
from capsule.store.fsutil import make_private_dir

log = logging.getLogger(__name__)
MARK = "incoming.json"           # in the instance directory while a move is under way
MAX_XML = 256 * 1024
_MOVE_ID = re.compile(r"[0-9a-f]{32}")
APPARMOR = "/sys/module/apparmor/parameters/enabled"
RECOVER = Bound(0, 3600, integer=False, unit="seconds")   # a source's recover timeout (capsule.migrate.recover)


def refusal(reason: str, detail: str) -> dict[str, str]:
    return {"reason": reason, "detail": detail}


def _text(req: dict[str, Any], key: str, limit: int = MAX_XML) -> str:
    value = req.get(key, "")
    if not isinstance(value, str) or len(value) > limit:
        raise InvalidName(f"malformed live move request: {key} must be text of at most {limit} characters")
    return value


def _request(req: Any) -> dict[str, Any]:
    if not isinstance(req, dict):
        raise InvalidName("malformed live move request: expected a JSON object")
    capsule = req.get("capsule")
    if not isinstance(capsule, str):
        raise InvalidName("malformed live move request: capsule must be a name")
    check_name(capsule)
    return req


def postcopy_ready() -> bool:
    """QEMU here can receive post-copy (it needs userfaultfd; libvirt hands it /dev/userfaultfd)."""
    return os.path.exists("/dev/userfaultfd")


def check_incoming(store: Store, req: Any) -> dict[str, Any]:
    """Why this host would refuse to receive ``req['capsule']`` live (``type``: the domain's type, kvm or
    qemu; ``cpu``: its ``<cpu>`` element; ``host``: libvirt's host UUID at the source), whether it can receive
    post-copy, and its own host UUID."""
    req = _request(req)
    name = req["capsule"]
    out: list[dict[str, str]] = []
    inst = store.catalogue.instance(name)
    here = host_uuid()
    source = _text(req, "host", 64).strip().lower()
    if source and here is not None and source == here:
        out.append(refusal("same_host", "the destination is this machine's own libvirt: a live move needs another "
                                        "host (move it with --offline)"))
    if inst is not None:
        out.append(refusal("running_there", f"{name} already has an instance on this host (domain {inst.domain}): "
                                            f"stop it there first"))
    if _text(req, "type", 16) == "kvm":
        cpu = _text(req, "cpu")
        if not os.path.exists("/dev/kvm"):
            out.append(refusal("no_kvm", f"{name} runs with KVM and this host has no /dev/kvm: "
                                         "move it with --offline (a suspended guest restarts under TCG)"))
        elif cpu:
            try:
                verdict = connect().compareCPU(cpu, 0)
            except libvirt.libvirtError as exc:
                verdict, why = libvirt.VIR_CPU_COMPARE_INCOMPATIBLE, exc.get_error_message()
            else:
                why = "this host's CPU lacks features the guest's CPU has"
            if verdict == libvirt.VIR_CPU_COMPARE_INCOMPATIBLE:
                out.append(refusal("cpu_incompatible", f"{why}: move it with --offline"))
    return {"refusals": out, "postcopy": postcopy_ready(), "host": here}


def prepare(store: Store, req: Any) -> dict[str, Any]:
    """Make what a live move of ``req['capsule']`` @ ``req['version']`` needs here (see the module's text):
    {id, domain, xml, postcopy}. ``tunnel``: the id of the tunnel session carrying its streams (see the module's
    text)."""
    req = _request(req)
    name = req["capsule"]
    number = int(check(VERSION, req.get("version"), "version"))
    saved_xml = _text(req, "xml")
    disks = req.get("disks")
    if not isinstance(disks, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in disks):
        raise InvalidName("malformed live move request: disks must be a list of virtual sizes in bytes")
    session = req.get("tunnel")
    if session is not None and (not isinstance(session, str) or not _MOVE_ID.fullmatch(session)):
        raise InvalidName("malformed live move request: tunnel must be a tunnel session's id (32 hexadecimal "
                          "digits)")
    recover = req.get("recover_timeout")
    if recover is not None:
        recover = float(check(RECOVER, recover, "recover_timeout"))
    with claims.claim(store, name, "receiving a live move"), store.lock(purpose=f"receiving {name}"):
        cat = store.catalogue
        version = cat.version(name, number)
        cap = cat.capsule(name)
        if version is None or cap is None:
            raise NotFound(f"{name}@{number} is not in this store: push it first")
        if cat.instance(name) is not None:
            raise Conflict(f"{name} already has an instance on this host: stop it here first")
        domain = store.domain_name(name)
        if lookup_domain(domain) is not None:
            raise Conflict(f"a libvirt domain named {domain} already exists here; remove it with virsh first")
        sizes = [cat.layer(chain[-1]).virtual_size for chain in version.chains]   # type: ignore[union-attr]
        if disks != sizes:
            raise Conflict(f"the running guest's disks ({disks}) are not those of {version.ref} here ({sizes})")
        inst_dir = store.instance_dir(name)
        if inst_dir.exists():
            shutil.rmtree(inst_dir)
        make_private_dir(inst_dir)
        leaves: list[Path] = []
        try:
            log = inst_dir / "console.log"
            log.touch(mode=0o600)
            for chain in version.chains:
                leaf = store.new_leaf_path()
                qemuimg.create_leaf(leaf, store.layer_path(chain[-1]))
                leaves.append(leaf)
            # (named as at the source: libvirt renames it to ``domain`` as it arrives, VIR_MIGRATE_PARAM_DEST_NAME)
            spec = memimage.restore_spec(store, version.config, saved_xml, name=_source_name(saved_xml), uuid=cap.uuid,
                                         disks=leaves,
                                         console_log=log, agent_socket=inst_dir / "agent.sock")
            xml, accel = restorexml.rebuild(saved_xml, spec)
            if recovery_possible():
                xml = qmp.with_monitor(xml, inst_dir / qmp.MONITOR)   # a post-copy that loses its link resumes
            memimage.grant(store, spec, version.chains)
            mid = secrets.token_hex(16)
            (inst_dir / MARK).write_text(json.dumps({"id": mid, "version": number, "since": time.time(),
                                                      "tunnel": session, "recover_timeout": recover}))
            with cat.transaction():
                cat.add_instance(InstanceRow(capsule=name, version=number, domain=domain,
                                             leaves=[str(p) for p in leaves], chains=version.chains, accel=accel,
                                             dir=str(inst_dir), started=time.time()))
        except BaseException:
            for leaf in leaves:
                leaf.unlink(missing_ok=True)
            shutil.rmtree(inst_dir, ignore_errors=True)
            raise
    return {"id": mid, "domain": domain, "xml": xml, "postcopy": postcopy_ready()}


def recover(store: Store, mid: str, channel: Callable[[str], Path]) -> dict[str, Any]:
    """The post-copy of move ``mid`` lost its link: QEMU here listens again (``migrate-recover``) at the path of
    its tunnel session's migration channel (``channel(session)``: this host's own choice, raising when the
    session ended or another token opened it), for the source's QEMU to resume the post-copy through a new
    connection (:mod:`capsule.migrate.recover`). libvirt completes the migration by itself once QEMU does."""
    with store.lock(purpose="recovering a live move's post-copy"):
        inst = _find(store, mid)
        mark = json.loads((Path(inst.dir) / MARK).read_text())
    dom = lookup_domain(inst.domain)
    if dom is None or not postcopy_failed(dom, incoming=True):
        raise Conflict(f"the move of {inst.capsule} is not a post-copy waiting for its link here")
    session = mark.get("tunnel")
    if not isinstance(session, str):
        raise Conflict(f"the move of {inst.capsule} names no tunnel session: its post-copy cannot resume")
    path = channel(session)
    monitor = Path(inst.dir) / qmp.MONITOR
    if not monitor.exists():
        raise Conflict(f"{inst.capsule} arrived here without a monitor to resume its post-copy with (AppArmor "
                       "confines QEMU on this host, or the instance's path is too long for a socket)")
    qmp.over_socket(monitor, "migrate-recover", uri=f"unix:{path}")
    return {"capsule": inst.capsule, "listening": True}


def recovery_possible() -> bool:
    """Whether QEMU here may open the monitor a post-copy's recovery needs (:func:`qmp.with_monitor`): not where
    AppArmor confines it (libvirt's profile for a domain names only the files of its XML)."""
    try:
        return Path(APPARMOR).read_text().strip() != "Y"
    except OSError:
        return True


def _source_name(xml: str) -> str:
    m = re.search(r"<name>(capsule-[0-9A-Za-z_.-]{1,120})</name>", xml)
    if m is None:
        raise InvalidName("malformed live move request: the domain XML names no capsule domain")
    return m[1]


def _find(store: Store, mid: str) -> InstanceRow:
    if not isinstance(mid, str) or not _MOVE_ID.fullmatch(mid):
        raise InvalidName("a live move's id is 32 hexadecimal digits")
    for inst in store.catalogue.instances():
        with contextlib.suppress(OSError, ValueError):
            if json.loads((Path(inst.dir) / MARK).read_text()).get("id") == mid:
                return inst
    raise NotFound(f"no live move {mid} is under way on this host")


def finish(store: Store, mid: str) -> dict[str, Any]:
    """The guest arrived: it runs here as the instance prepare recorded."""
    with store.lock(purpose="finishing a live move"):
        inst = _find(store, mid)
        dom = lookup_domain(inst.domain)
        if dom is None or not dom.isActive():
            raise Conflict(f"{inst.capsule} did not arrive here (no running domain {inst.domain}); "
                           "abort the move")
        state, _reason = dom.state()
        try:
            stats = dom.jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)
        except libvirt.libvirtError:
            stats = {}
        (Path(inst.dir) / MARK).unlink(missing_ok=True)
    figures = {k: int(stats[k]) for k in ("downtime", "memory_processed", "disk_processed", "memory_iteration",
                                          "time_elapsed") if isinstance(stats.get(k), int)}
    return {"capsule": inst.capsule, "version": f"{inst.capsule}@{inst.version}", "domain": inst.domain,
            "running": state == libvirt.VIR_DOMAIN_RUNNING, "downtime_ms": figures.get("downtime"), "job": figures}


def abort(store: Store, mid: str) -> dict[str, Any]:
    """The move stopped before the guest ran here: remove what prepare made (a domain still arriving is
    destroyed)."""
    with store.lock(purpose="aborting a live move"):
        inst = _find(store, mid)
        remove(store, inst)
    return {"capsule": inst.capsule, "aborted": True}


def remove(store: Store, inst: InstanceRow) -> None:
    """(Store lock held.) What prepare made for ``inst`` goes: its arriving domain, its row, leaves, directory."""
    dom = lookup_domain(inst.domain)
    if dom is not None:
        try:
            dom.destroy()
        except libvirt.libvirtError as exc:
            if dom.isActive():
                raise RuntimeFailure(f"the incoming domain {inst.domain} could not be removed: "
                                     f"{exc.get_error_message()}") from exc
    with store.catalogue.transaction():
        store.catalogue.delete_instance(inst.capsule)
    for leaf in inst.leaves:
        Path(leaf).unlink(missing_ok=True)
    shutil.rmtree(inst.dir, ignore_errors=True)


def unfinished(store: Store) -> list[tuple[InstanceRow, dict[str, Any]]]:
    out = []
    for inst in store.catalogue.instances():
        with contextlib.suppress(OSError, ValueError):
            mark = json.loads((Path(inst.dir) / MARK).read_text())
            if isinstance(mark, dict):
                out.append((inst, mark))
    return out


def _runs_here(inst: InstanceRow) -> bool:
    """The arriving guest already runs here: the switchover happened (its source stopped it), or post-copy
    started. Destroying it would lose the machine; it is kept, as this host's instance. Not a post-copy still
    under way or one that lost its link (:mod:`capsule.exchange.stranded`): with its session gone it can never
    complete (it lacks pages only its source holds), and its source starts the capsule again itself."""
    dom = lookup_domain(inst.domain)
    now = state_of(dom) if dom is not None else None
    return now is not None and now[0] == libvirt.VIR_DOMAIN_RUNNING and now[1] not in (
        libvirt.VIR_DOMAIN_RUNNING_POSTCOPY, libvirt.VIR_DOMAIN_RUNNING_POSTCOPY_FAILED)


def sweep(store: Store, session: str | None = None) -> list[str]:
    """Remove the incoming moves that never finished: all of them (``session`` None: the agent starts, so no
    stream of theirs is left), or those whose tunnel session ``session`` ended. The capsules' names. A move whose
    guest already runs here (its source went away between the switchover and ``finish``) is never removed: it
    is adopted as this host's instance, as ``finish`` would have."""
    if session is None and not unfinished(store):
        return []
    gone = []
    with store.lock(timeout=None, purpose="removing unfinished live moves"):
        for inst, mark in unfinished(store):
            if session is not None and mark.get("tunnel") != session:
                continue
            if _runs_here(inst):
                (Path(inst.dir) / MARK).unlink(missing_ok=True)
                log.warning("%s arrived and runs here although its move never finished: kept as this host's "
                            "instance", inst.capsule)
                continue
            remove(store, inst)
            gone.append(inst.capsule)
    return gone


def sweep_quietly(store: Store, session: str | None = None) -> None:
    """:func:`sweep` for the agent (at its start, as a tunnel session ends): a failure is logged, not raised."""
    try:
        gone = sweep(store, session)
    except Error as exc:
        log.warning("unfinished live moves could not be removed: %s", exc)
        return
    if gone:
        log.warning("removed unfinished incoming live moves of %s", ", ".join(gone))
