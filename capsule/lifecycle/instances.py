"""Running capsules: start (boot or restore on fresh leaves), suspend,
snapshot and stop. Suspend and stop seal the instance's leaves into layers
and record a new version in one transaction."""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import libvirt

from capsule import privsep, qemuimg, watch
from capsule.capsules import resolve
from capsule.console.serial import log_size, wait_for_marker
from capsule.errors import Conflict, IntegrityError, NotFound, RuntimeFailure, StorageFull
from capsule.lifecycle import balloon as balloon_mod
from capsule.lifecycle import chaindepth, demand, memimage, sealing
from capsule.names import parse_ref
from capsule.runtime import podnet
from capsule.runtime.accel import AccelDecision, decide, default_cache
from capsule.runtime.connection import connect, lookup_domain
from capsule.runtime.domainxml import build
from capsule.store import Store, claims
from capsule.store.catalogue import FileRow, InstanceRow, LayerRow, VersionRow
from capsule.store.fsutil import is_enospc, make_private_dir
from hashcache.errors import HashcacheError
from hashcache.manifest import verify_file
from hashcache.qcow2 import Qcow2Image

Say = sealing.Say
Release = sealing.Release
BOOT_TIMEOUT = 180.0
USER_NETWORK = "user-network"   # in the instance's directory: it was booted with a NIC (update make only)


def _quiet(_msg: str) -> None:
    pass


@dataclass
class StartResult:
    version: VersionRow
    domain: str
    mode: str                 # "boot" or "restore"
    accel: str
    seconds: float            # until running (restore) or until the marker (boot, when waited for)
    forked_memory: bool = False


@dataclass
class SealResult:
    version: VersionRow | None          # None when nothing changed (stop without writes)
    layers: list[LayerRow] = field(default_factory=list)
    memory: FileRow | None = None
    save_seconds: float = 0.0
    seal_seconds: float = 0.0
    balloon: balloon_mod.BalloonResult | None = None
    zero_marks_dropped: int = 0         # stop(compact=True): discarded blocks the parent already read as zero
    released_blocks: int = 0            # stop(release=…): blocks of dead content dropped (the parent's show)


def accel_for(store: Store, refresh: bool = False) -> AccelDecision:
    probe = None
    for img in store.catalogue.images():
        if img.kind == "tiny":
            probe = (store.file_path(img.kernel), store.file_path(img.initrd), img.cmdline, img.marker)
            break
    return decide(default_cache(), probe, refresh=refresh)


def _instance_files(store: Store, capsule: str) -> tuple[Path, Path, Path]:
    d = store.instance_dir(capsule)
    if d.exists():
        shutil.rmtree(d)
    make_private_dir(d)
    log = d / "console.log"
    log.touch(mode=0o600)   # ours: virtlogd (root) appends to it, an agent that is not root still reads it
    return d, log, d / "agent.sock"


def _check_objects(store: Store, version: VersionRow) -> None:
    """Refuse to start from a corrupt layer header or a tampered memory image
    (a memory image is re-hashed: cheap next to restoring it)."""
    for chain in version.chains:
        for lid in chain:
            path = store.layer_path(lid)
            if demand.is_remote(store, lid):
                if not demand.remote_manifest_path(store, lid).exists():
                    raise IntegrityError(f"remote layer {lid[:12]} of {version.ref} has no manifest here")
                url = demand.remote_info(store, lid)["url"]
                if not demand.token_path(store, url).exists() and not url.startswith(("http://", "https://")):
                    raise Conflict(f"layer {lid[:12]} of {version.ref} is still read from the repository at {url}, "
                                   "and its key was removed here when the run that read it stopped: start it "
                                   f"again with `capsule start {version.ref} --from {url}` (add --prefetch to "
                                   "bring every block and then `capsule localize`)")
                if not demand.token_path(store, url).exists():
                    raise Conflict(f"layer {lid[:12]} of {version.ref} is still read from {url}, and this host's "
                                   "grant to read it there ended when its demand run stopped: run it from there "
                                   f"again (`capsule start {version.capsule}@V --from {url}` with a token of that "
                                   "host), or copy it here first")
                continue
            if not path.exists():
                raise IntegrityError(f"layer {lid[:12]} of {version.ref} is missing from the store")
            try:
                with Qcow2Image(path):
                    pass
            except (HashcacheError, OSError) as exc:
                raise IntegrityError(f"layer {lid[:12]} of {version.ref} is corrupt ({exc}); "
                                     "`capsule verify` checks the whole store") from exc
    if version.memory:
        path = store.file_path(version.memory)
        if not path.exists():
            raise IntegrityError(f"the memory image of {version.ref} is missing from the store")
        try:
            verify_file(path, store.file_manifest(version.memory), f"memory image {version.memory[:12]}")
        except HashcacheError as exc:
            raise IntegrityError(f"{version.ref} will not be restored: {exc}") from exc


def start(store: Store, ref: str, *, wait: bool = True, timeout: float = BOOT_TIMEOUT, prefetch: bool = False,
          boot: bool = False, network: str | None = None, kernel_args: str = "",
          say: Say = _quiet) -> StartResult:
    """Boot an inactive version or restore an active one, on fresh leaves. ``boot``: boot even an active
    version (its memory image is not used; its disks are as they were saved). ``network``: a booted guest
    gets a NIC on QEMU's user-mode network (``ADDRESS/PREFIX``, see ``domainxml.add_user_network``).
    ``kernel_args``: appended to a boot's kernel command line for this run only.

    The capsule is claimed ("starting") until its instance is recorded; the store lock is held only while
    its leaves and domain are made, never while the guest is waited for (its memory given back after a
    restore, its boot marker)."""
    with claims.claim(store, parse_ref(ref).name, "starting"):
        decision = accel_for(store)   # (a host's first start may boot a probe guest: not under the store lock)
        made = _make_instance(store, ref, boot=boot, prefetch=prefetch, network=network, kernel_args=kernel_args,
                              decision=decision, say=say)
        if made.give_back is not None:
            claims.check_unlocked(store, "giving a restored guest its memory back")
            say("giving the guest its memory back")
            balloon_mod.give_back(made.agent_sock, lookup_domain(made.result.domain), made.give_back)
    r = made.result
    r.seconds = time.monotonic() - made.t0
    if r.mode == "boot" and wait:   # (unclaimed: its owner may stop a guest that never comes up)
        say("waiting for the guest to come up")
        r.seconds += wait_for_marker(made.log, r.version.config["marker"], timeout, domain=r.domain)
    return r


@dataclass
class _Made:
    result: StartResult
    t0: float
    log: Path
    agent_sock: Path
    give_back: dict | None      # a restored version's balloon record: its memory is to be given back


def _make_instance(store: Store, ref: str, *, boot: bool, prefetch: bool, network: str | None,
                   kernel_args: str, decision: AccelDecision, say: Say) -> _Made:
    """``start``'s part under the store lock: checks, leaves, the domain booted or restored, the instance."""
    with store.lock(purpose=f"starting {ref}"):
        version = resolve(store, ref)
        cat = store.catalogue
        name = version.capsule
        existing = cat.instance(name)
        if existing is not None:
            if lookup_domain(existing.domain) is not None:
                raise Conflict(f"capsule {name!r} is already running (domain {existing.domain})")
            raise Conflict(f"capsule {name!r} has a stale instance whose domain is gone; "
                           f"run `capsule stop {name}` to keep its disk changes as a new version")
        cap = cat.capsule(name)
        assert cap is not None
        domain = store.domain_name(name)
        if lookup_domain(domain) is not None:
            raise Conflict(f"a libvirt domain named {domain} already exists; remove it with virsh first")
        _check_objects(store, version)
        memory = None if boot else version.memory
        if memory:  # refuse an image this host would not restore before anything is made
            memimage.check(store, version.config, store.file_path(memory), name=domain, uuid=cap.uuid,
                           disks=len(version.chains), instance_dir=store.instance_dir(name))
        if version.config.get(podnet.CONFIG_KEY):
            say(f"joining the host's pod bridge {privsep.current().pod_bridge_up()}")
        inst_dir, log, agent_sock = _instance_files(store, name)
        if network:
            (inst_dir / USER_NETWORK).write_text(network)
        leaves: list[Path] = []
        try:
            chains = chaindepth.shallow(store, version.chains, say)
            servers = demand.start_servers(store, inst_dir, chains, prefetch)
            if servers:
                say("disk server started: remote blocks are fetched as the guest reads them")
            for i, chain in enumerate(chains):
                leaf = store.new_leaf_path()
                if i in servers:
                    demand.create_leaf_over(leaf, servers[i])
                else:
                    qemuimg.create_leaf(leaf, store.layer_path(chain[-1]))
                leaves.append(leaf)
            sockets = {i: s.socket_path for i, s in servers.items()}
            t0 = time.monotonic()
            forked = False
            if memory:
                mode = "restore"
                say(f"restoring {version.ref} from its memory image")
                restored = memimage.restore(store, version.ref, version.config, store.file_path(memory),
                                            name=domain, uuid=cap.uuid, disks=leaves, instance_dir=inst_dir,
                                            disk_servers=sockets, chains=chains)
                accel, forked = restored.accel, restored.forked
            else:
                mode = "boot"
                accel = decision.accel
                spec = memimage.machine_spec(store, version.config, name=domain, uuid=cap.uuid, accel=accel,
                                             disks=leaves, console_log=log, agent_socket=agent_sock,
                                             disk_servers=sockets)
                spec.user_network = network
                if kernel_args:
                    spec.cmdline = f"{spec.cmdline} {kernel_args}"
                say(f"booting {version.ref} ({accel})")
                memimage.grant(store, spec, chains)
                try:
                    connect().createXML(build(spec), 0)
                except libvirt.libvirtError as exc:
                    raise RuntimeFailure(f"booting {version.ref} failed: {exc.get_error_message()}") from exc
            if servers:
                urls = sorted({demand.remote_info(store, lid)["url"] for chain in chains for lid in chain
                               if demand.is_remote(store, lid)})
                watch.spawn(domain, urls, inst_dir / "watch.log", inst_dir)
            inst = InstanceRow(capsule=name, version=version.number, domain=domain,
                               leaves=[str(p) for p in leaves], chains=chains, accel=accel,
                               dir=str(inst_dir), started=time.time())
            with cat.transaction():
                cat.add_instance(inst)
        except BaseException:
            dom = lookup_domain(domain)
            if dom is not None:
                with contextlib.suppress(libvirt.libvirtError):
                    dom.destroy()
            for leaf in leaves:
                leaf.unlink(missing_ok=True)
            demand.stop_servers(inst_dir)
            raise
    give_back = version.config.get("balloon") if memory else None
    return _Made(StartResult(version, domain, mode, accel, 0.0, forked), t0, log, agent_sock, give_back or None)


def _running_instance(store: Store, name: str) -> tuple[InstanceRow, libvirt.virDomain]:
    resolve(store, name)
    inst = store.catalogue.instance(name)
    if inst is None:
        raise Conflict(f"capsule {name!r} is not running (`capsule start {name}`)")
    dom = lookup_domain(inst.domain)
    if dom is None:
        raise Conflict(f"capsule {name!r} has a stale instance whose domain is gone; "
                       f"`capsule stop {name}` keeps its disk changes")
    return inst, dom


def suspend(store: Store, name: str, *, note: str = "suspended", balloon: str | None = None,
            balloon_method: str = balloon_mod.DEFAULT_METHOD, say: Say = _quiet,
            phase: Say = _quiet) -> SealResult:
    """Save the running capsule (libvirt ``sparse`` format), seal its leaves and
    record a new active version. With ``balloon`` (a policy: none, cache,
    aggressive) the guest's spare memory is zeroed first (§4.1). On failure
    the guest keeps running (with its memory given back) and nothing is
    recorded. ``phase("balloon")`` and ``phase("save")`` are called as each
    step begins; if ``phase`` raises (a cancel), the guest keeps running.

    The capsule is claimed ("suspending") throughout; the balloon and the save run without the store lock,
    which is taken for the sealing and the record."""
    with claims.claim(store, name, "suspending"):
        with store.lock(purpose=f"suspending {name}"):
            inst, dom = _running_instance(store, name)
            if (Path(inst.dir) / USER_NETWORK).exists():
                raise Conflict(f"{name} runs with a NIC for `capsule update make`, which a memory image cannot "
                               "keep; let the update finish (or interrupt it)")
        claims.check_unlocked(store, f"suspending {name}")
        agent_sock = Path(inst.dir) / "agent.sock"
        ballooned: balloon_mod.BalloonResult | None = None
        if balloon is not None:
            balloon_mod.check(balloon, balloon_method)
            phase("balloon")
            say(f"ballooning ({balloon_method}, {balloon})")
            ballooned = balloon_mod.inflate(agent_sock, dom, balloon, balloon_method)
            if ballooned.skipped:
                say(f"no ballooning: {ballooned.skipped}")
        balloon_info = ballooned.as_dict() if ballooned and not ballooned.skipped else None
        try:
            phase("save")
        except BaseException:
            if ballooned is not None:
                balloon_mod.give_back(agent_sock, dom, balloon_info)
            raise
        tmp = store.temp_path(".save")
        say("saving memory (sparse)")
        t0 = time.monotonic()
        try:
            dom.saveParams({libvirt.VIR_DOMAIN_SAVE_PARAM_FILE: str(tmp),
                            libvirt.VIR_DOMAIN_SAVE_PARAM_IMAGE_FORMAT: "sparse"}, 0)
        except libvirt.libvirtError as exc:
            tmp.unlink(missing_ok=True)
            if balloon_info:
                balloon_mod.give_back(agent_sock, lookup_domain(inst.domain), balloon_info)
            msg = exc.get_error_message()
            if is_enospc(exc):
                raise StorageFull(f"suspending {name}: the store's file system is full ({msg}); "
                                  "the capsule keeps running and nothing was recorded") from exc
            raise RuntimeFailure(f"suspending {name} failed: {msg}; the capsule keeps running") from exc
        save_seconds = time.monotonic() - t0
        t1 = time.monotonic()
        memory: FileRow | None = None
        sealed: list[LayerRow] = []
        recorded = False
        try:
            with store.lock(timeout=None, purpose=f"sealing {name}"):   # saved: it is recorded, or resumed
                try:
                    say("sealing memory image")
                    privsep.current().adopt_memory_image(tmp)   # libvirtd (root) wrote it: the store owner's to seal
                    memory = store.seal_file(tmp, "memory")
                    chains, layers = sealing.seal_leaves(store, inst, say, sealed)
                    version = sealing.record_sealed(store, inst, chains, layers, memory, note, balloon_info)
                    recorded = True
                except BaseException:
                    image = tmp if tmp.exists() else (store.file_path(memory.id) if memory else None)
                    sealing.resume_after_failed_seal(store, inst, image, sealed)
                    raise
                demand.stop_servers(Path(inst.dir))
                shutil.rmtree(inst.dir, ignore_errors=True)
        except BaseException:
            if balloon_info and not recorded:      # the guest runs again: its memory back, without the lock
                balloon_mod.give_back(agent_sock, lookup_domain(inst.domain), balloon_info)
            raise
        return SealResult(version, layers, memory, save_seconds, time.monotonic() - t1, ballooned)


def snapshot(store: Store, name: str, *, balloon: str | None = None,
             balloon_method: str = balloon_mod.DEFAULT_METHOD, note: str = "snapshot",
             say: Say = _quiet) -> tuple[SealResult, StartResult]:
    """Suspend, then immediately resume on a new leaf: the guest keeps running. ``note`` is recorded
    with the version (in the same transaction). The capsule stays claimed ("snapshotting") from the
    suspend to the restore."""
    with claims.claim(store, name, "snapshotting"):
        sealed = suspend(store, name, note=note, balloon=balloon, balloon_method=balloon_method, say=say)
        assert sealed.version is not None
        resumed = start(store, sealed.version.ref, wait=False, say=say)
    return sealed, resumed


def stop(store: Store, name: str, *, timeout: float = 30.0, force: bool = False, discard: bool = False,
         compact: bool = False, release: Release | None = None, note: str = "stopped",
         say: Say = _quiet) -> SealResult:
    """Shut the guest down (forced after ``timeout``), then keep its disk
    changes as a new inactive version — or drop them (``discard``: a fleet
    host's system disk, replaced by the fleet's next version). ``compact``: leaves
    lose the zero marks their chains already read as zero before they are sealed, and (``release``, a
    callable ``(disk index, leaf, chain) → blocks``, asked after the guest is off) blocks whose content
    the caller knows is dead (``update make``: the ext4 journal, see ``capsule.update.journal``). A demand run's
    sources that no running instance reads from any more are told its run ended: their grants end
    (:func:`capsule.lifecycle.demand.release_sources`).

    The capsule is claimed ("stopping") throughout: another operation on it is refused meanwhile. The
    guest's shutdown is waited for without the store lock, which is taken to seal and record."""
    with claims.claim(store, name, "stopping"):
        with store.lock(purpose=f"stopping {name}"):
            resolve(store, name)
            inst = store.catalogue.instance(name)
            if inst is None:
                raise Conflict(f"capsule {name!r} is not running")
        _shut_down(store, inst, timeout, force, say)
        with store.lock(timeout=None, purpose=f"sealing {name}"):   # the guest is off: its changes are kept
            inst = store.catalogue.instance(name)
            if inst is None:
                raise Conflict(f"capsule {name!r} stopped meanwhile: its instance is gone")
            result = _seal_stopped(store, inst, discard=discard, compact=compact, release=release, note=note,
                                   say=say)
    sources = demand.sources_of(store, [lid for chain in inst.chains for lid in chain])
    if sources:
        demand.release_sources(store, sources, since=inst.started)
    return result


def _shut_down(store: Store, inst: InstanceRow, timeout: float, force: bool, say: Say) -> None:
    """Ask the guest to shut down and wait for it (at most ``timeout`` seconds), then force it off."""
    dom = lookup_domain(inst.domain)
    if dom is None:
        return
    claims.check_unlocked(store, f"stopping {inst.capsule}")
    if not force:
        say("asking the guest to shut down")
        with contextlib.suppress(libvirt.libvirtError):
            dom.shutdown()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and lookup_domain(inst.domain) is not None:
            time.sleep(0.2)
    if lookup_domain(inst.domain) is not None:
        say("forcing the guest off")
        with contextlib.suppress(libvirt.libvirtError):
            dom.destroy()


def _seal_stopped(store: Store, inst: InstanceRow, *, discard: bool, compact: bool, release: Release | None,
                  note: str, say: Say) -> SealResult:
    """``stop``'s part under the store lock, the guest off: its leaves sealed into a version, or dropped."""
    name = inst.capsule
    t1 = time.monotonic()
    if discard:
        demand.stop_servers(Path(inst.dir))
        with store.catalogue.transaction():
            store.catalogue.delete_instance(name)
        for leaf in inst.leaves:
            Path(leaf).unlink(missing_ok=True)
        shutil.rmtree(inst.dir, ignore_errors=True)
        return SealResult(None, [], None, 0.0, time.monotonic() - t1)
    dropped: list[int] = []
    released: list[int] = []
    chains, layers = sealing.seal_leaves(store, inst, say, compacted=dropped if compact else None,
                                         release=release, released=released)
    demand.stop_servers(Path(inst.dir))
    if layers:
        version: VersionRow | None = sealing.record_sealed(store, inst, chains, layers, None, note)
    else:
        with store.catalogue.transaction():
            store.catalogue.delete_instance(name)
        version = None
    shutil.rmtree(inst.dir, ignore_errors=True)
    return SealResult(version, layers, None, 0.0, time.monotonic() - t1, zero_marks_dropped=sum(dropped),
                      released_blocks=sum(released))


def console_log(store: Store, name: str) -> Path:
    inst = store.catalogue.instance(name)
    if inst is None:
        raise NotFound(f"capsule {name!r} is not running")
    return Path(inst.dir) / "console.log"


__all__ = ["StartResult", "SealResult", "start", "suspend", "snapshot", "stop", "console_log", "log_size"]
