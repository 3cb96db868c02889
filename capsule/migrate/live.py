"""A live move: the guest keeps running here while its disks and memory travel, and pauses only for the
switchover (at most ``max_pause`` seconds, libvirt's max downtime).

1. pre-check (:mod:`capsule.migrate.precheck`): every reason it would fail, before anything changes;
2. T0: the disks are sealed into a version while the guest runs (``lifecycle.livedisk``), and that version
   is pushed with HCP: the bulk of the disks travels deduplicated (only blocks the other host lacks);
3. a tunnel set is opened to the other host's agent (:func:`capsule.migrate.tunnelset.open_tunnels`: libvirtd to
   libvirtd, QEMU's migration stream, the disks' NBD — each carried over the agents' own connection, with the
   peer's token and pinned certificate; no other port between the hosts), and the other host prepares an
   instance on that version (``POST /v1/live/prepare``, naming the tunnel session) and answers the domain XML
   to run it with there (built from its own template);
4. libvirt migrates it (``migrateToURI3``, peer to peer, through the tunnels): memory in pre-copy rounds while
   the guest runs, and only the disks' writes since T0 (each disk's new top leaf, over NBD); it switches over
   when what remains fits ``max_pause``. Only with ``postcopy`` (asked for) may it switch to post-copy when
   pre-copy does not converge: the guest runs there while its last pages follow — if the link breaks then, the
   post-copy resumes when it returns within ``recover_timeout``, else the guest boots here from its disks as they
   were at the switchover (:mod:`capsule.migrate.recover`);
5. the other host adopts the guest as its instance (``finish``); here the instance ends (T0 stays, as
   history), and the tunnels close. Cancelled (or failed, the link cut) before the switchover: libvirt's job is
   aborted, the guest runs on here, and the other host removes what it prepared (``abort``; or by itself when
   the tunnel session ends, or when its agent starts again)."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libvirt

from capsule import transfer
from capsule.agentclient import AgentClient
from capsule.bounds import WIRE_BYTES, Bound
from capsule.errors import Cancelled, Conflict, Error, RuntimeFailure
from capsule.lifecycle import SealResult, livedisk
from capsule.migrate import jobwatch, memrefs, recover
from capsule.migrate import precheck as checks
from capsule.migrate.jobwatch import LiveFigures
from capsule.migrate.progress import CancelToken, Snapshot, Tracker, planned
from capsule.migrate.switchover import SwitchoverRate
from capsule.migrate.tunnelset import Tunnels, open_tunnels
from capsule.runtime.connection import lookup_domain, postcopy_failed
from capsule.store import Store, claims

NOTE = "live move: disks at T0"
QEMU_SHARE = 0.5        # of --max-pause, QEMU's downtime limit (qemu_downtime_ms)
THROTTLE_INITIAL = 50   # % of the vCPUs' time auto-converge takes first from a guest whose rounds do not shrink
THROTTLE_INCREMENT = 20  # % more at each round that still does not (QEMU's defaults: 20 and 10)
TUNNEL_TTL = 600.0      # seconds the other host admits the move's connections (libvirt opens them at the start)
RECOVER_TIMEOUT = 120.0  # seconds a post-copy whose link broke waits for it to return (--recover-timeout)
RECOVER_CALL = 15.0     # seconds one call asking the other host to listen again may take


@dataclass(frozen=True)
class Routes:
    """How this host's libvirt reaches the other host's for one move: its libvirtd, QEMU's migration stream,
    the disks' NBD stream (the entrances of a tunnel set here)."""

    libvirt_uri: str
    migration_uri: str
    disks_uri: str

    @classmethod
    def of(cls, t: Tunnels) -> Routes:
        if t.libvirt_uri is None or t.migration_uri is None or t.disks_uri is None:
            raise Conflict("the tunnel to the other host lacks a channel for the migration's streams")
        return cls(t.libvirt_uri, t.migration_uri, t.disks_uri)


class LiveRefused(Conflict):
    """The pre-check found reasons a live move would fail; nothing changed."""

    code = "live_move_refused"
    fields = ("refusals",)

    def __init__(self, message: str, refusals: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.refusals = refusals or []


@dataclass
class Moved:
    sealed: SealResult
    push: transfer.TransferReport
    remote: dict[str, Any]
    figures: LiveFigures = field(default_factory=LiveFigures)


def refuse(name: str, refusals: list[checks.Refusal]) -> LiveRefused:
    lines = "; ".join(f"{r.detail}" for r in refusals)
    return LiveRefused(f"{name} cannot move live: {lines}", [r.as_dict() for r in refusals])


def move(store: Store, name: str, to: str, token: str, *, max_pause: float, postcopy: bool, pin: str | None,
         tracker: Tracker, cancel: CancelToken, say: Callable[[str], None],
         recover_timeout: float = RECOVER_TIMEOUT) -> Moved:
    """The live move itself (see the module's text); raises :class:`LiveRefused`, or the failure with the
    guest still running here unless the other host may run it (see :func:`capsule.migrate.move.migrate`)."""
    tracker.enter("precheck", f"checking {name} here and at {to}")
    target = checks.Target(to, token, pin)
    refusals, xml = checks.local_refusals(store, name)
    answer: dict[str, Any] = {}
    if xml is not None:
        there, answer = checks.remote_refusals(name, xml, target)
        refusals += there
        if postcopy and not there and answer.get("postcopy") is not True:
            refusals.append(checks.Refusal("no_postcopy", f"the host at {to} cannot receive post-copy (its QEMU "
                                                          "lacks userfaultfd): move it without --postcopy"))
    if refusals:
        raise refuse(name, refusals)
    cancel.check()
    with claims.claim(store, name, "migrating"):
        tracker.enter("disks", "sealing the disks at T0 (the guest runs on)")
        say("sealing the disks at T0")
        sealed = livedisk.seal_disks_running(store, name, NOTE, doing="migrating")
        version = sealed.version
        tracker.set_version(version.ref)
        tracker.totals({"disks": _disk_bytes(store, version.chains)})
        say(f"pushing {version.ref}")
        pushed = transfer.push(store, version.ref, to, token, progress=tracker, check=cancel.check, fingerprint=pin)
        cancel.check()
        result = SealResult(version, sealed.layers, None, 0.0, sealed.pause)
        try:
            remote, figures = _migrate(store, name, target, sealed.instance, version, max_pause, postcopy,
                                       tracker, cancel, say, recover_timeout)
        except recover.PostcopyLost as lost:
            gave_up = lost
        else:
            _end_here(store, sealed.instance)
            return Moved(result, pushed, remote, figures)
    ref = recover.start_here(store, name, say)      # (unclaimed: it stops and starts the capsule itself)
    raise recover.PostcopyLost(f"{gave_up}; {name} was started again here from its disks as they were at the "
                               f"switchover ({ref}): what it held only in memory, and what it did at {to} after the "
                               f"switchover, is lost") from gave_up


def _disk_bytes(store: Store, chains: list[list[str]]) -> int:
    layers = dict.fromkeys(lid for chain in chains for lid in chain)
    return sum(transfer.raw_size(store, "layer", lid) for lid in layers)


def _migrate(store: Store, name: str, target: checks.Target, inst: Any, version: Any, max_pause: float,
             postcopy: bool, tracker: Tracker, cancel: CancelToken, say: Callable[[str], None],
             recover_timeout: float) -> tuple[dict[str, Any], LiveFigures]:
    dom = lookup_domain(inst.domain)
    if dom is None:
        raise Conflict(f"{name}'s domain {inst.domain} is gone: nothing to move")
    xml = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_MIGRATABLE)
    targets = livedisk.targets_of(dom, inst.leaves)
    sizes = [store.catalogue.layer(chain[-1]).virtual_size for chain in version.chains]  # type: ignore[union-attr]
    with AgentClient(target.url, target.token, timeout=120.0, fingerprint=target.fingerprint) as client:
        say("opening the tunnel to the other host")
        tunnels = open_tunnels(target, ttl=TUNNEL_TTL + recover_timeout,   # (a resumed post-copy connects anew)
                               dedup=memrefs.dedup_terms(store, version, client))
    try:
        with AgentClient(target.url, target.token, timeout=120.0, fingerprint=target.fingerprint) as client:
            prep = client.post_json("/v1/live/prepare", {"capsule": name, "version": inst.version, "xml": xml,
                                                         "disks": sizes, "tunnel": tunnels.session,
                                                         "recover_timeout": recover_timeout})
            mid = str(prep.get("id", ""))
            try:
                link = lambda: tunnels.bytes_sent + tunnels.bytes_received  # noqa: E731
                figures = _run_job(dom, Routes.of(tunnels), prep, targets, max_pause, postcopy, tracker, cancel,
                                   say, link, _switchover(dom, tunnels), recover_timeout,
                                   lambda: _listen_there(target, mid))
            except BaseException as exc:
                gone = None
                try:
                    client.post_json(f"/v1/live/{mid}/abort", {})
                except Error as err:
                    gone = err
                    say(f"the other host could not remove what it prepared (it does when the tunnel ends or its "
                        f"agent starts again): {err}")
                if isinstance(exc, RuntimeFailure) and not isinstance(exc, recover.PostcopyLost):
                    # libvirt only says that its stream ended
                    broke = _tunnel_errors(tunnels)
                    if broke or gone is not None:
                        why = broke[-1] if broke else f"its agent does not answer ({gone})"
                        raise RuntimeFailure(f"{exc}; the link to the other host broke: {why}") from exc
                raise
            remote = client.post_json(f"/v1/live/{mid}/finish", {})
        figures.tunnel_bytes = tunnels.bytes_sent + tunnels.bytes_received
        figures.record_tunnels(tunnels)
    finally:
        tunnels.close()
    take_reported(remote, figures, tracker)
    return remote, figures


ROUNDS = Bound(0, 10**9)                            # pre-copy iterations a peer may report
PAUSE_MS = Bound(0, 86_400_000, unit="ms")          # a pause a peer may report: at most a day


def take_reported(remote: dict[str, Any], figures: LiveFigures, tracker: Tracker) -> None:
    """The other host's figures of the completed job (a short job is seen once or never while it runs), each
    taken only within its bounds: they come from the network, and a figure out of bounds is left out (the move
    itself is done)."""
    reported = remote.get("job")
    job: dict[str, Any] = reported if isinstance(reported, dict) else {}
    for key, attr, bound in (("memory_processed", "memory_bytes", WIRE_BYTES),
                             ("disk_processed", "disk_bytes", WIRE_BYTES), ("memory_iteration", "rounds", ROUNDS)):
        if bound.contains(job.get(key)):
            setattr(figures, attr, max(getattr(figures, attr), int(job[key])))
    if PAUSE_MS.contains(remote.get("downtime_ms")):
        figures.pause_ms = int(remote["downtime_ms"])
        tracker.pause(figures.pause_ms)


def _listen_there(target: checks.Target, mid: str) -> object:
    """The other host's QEMU listens again for a post-copy that lost its link (a short call: the link may be
    down still, and the next try comes soon)."""
    with AgentClient(target.url, target.token, timeout=RECOVER_CALL, fingerprint=target.fingerprint) as client:
        return client.post_json(f"/v1/live/{mid}/recover", {})


ERRORS_SETTLE = 2.0   # seconds a failed move waits for the tunnel's threads to record why its link broke


def _tunnel_errors(tunnels: Tunnels, settle: float = ERRORS_SETTLE) -> list[str]:
    """Why the tunnel's connections broke. libvirt can report its ended stream before the tunnel's thread has
    recorded the cause, so an empty answer is asked again for up to ``settle`` seconds."""
    deadline = time.monotonic() + settle
    while True:
        broke = [e for t in tunnels.tunnels.values() for e in t.errors]
        if broke or time.monotonic() >= deadline:
            return broke
        time.sleep(0.1)


def qemu_downtime_ms(max_pause: float) -> int:
    """QEMU's own budget for the switchover's copy: :data:`QEMU_SHARE` of the pause budget. The rest is for
    what the pause holds beyond that copy: the link's queue draining the last bytes QEMU wrote, libvirt's finish
    calls across the link, the disks' mirror ending (B2-live at 8 Mbit/s: a guest paused 1.9 s by its clock
    where QEMU's whole budget was 1 s)."""
    return max(1, round(max_pause * QEMU_SHARE * 1000))


def migrate_flags(postcopy: bool) -> int:
    """libvirt's flags for a live move: VIR_MIGRATE_POSTCOPY when post-copy was asked for (a guest that dirties
    memory faster than the link carries switches to it); otherwise VIR_MIGRATE_AUTO_CONVERGE: such a guest's vCPUs
    are throttled, more and more, until pre-copy converges (QEMU does so only when rounds stop shrinking: a guest
    that converges by itself runs at full speed throughout).

    The disks' writes since T0 are mirrored with VIR_MIGRATE_NON_SHARED_SYNCHRONOUS_WRITES (QEMU's
    ``write-blocking`` mirror): once the mirror has caught up, a guest write completes only when the other host
    has it too. A background mirror lets writes pile up while memory fills the link, and libvirt ends it inside
    the pause: B2-live's desktop, whose office day writes ~15 MB over the move, was paused 0.9-1.9 s longer than
    QEMU's downtime, where guests that wrote nothing were paused no longer. A guest write waits for the link
    instead, during the move only."""
    flags = (libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PEER2PEER | libvirt.VIR_MIGRATE_NON_SHARED_INC
             | libvirt.VIR_MIGRATE_NON_SHARED_SYNCHRONOUS_WRITES | libvirt.VIR_MIGRATE_ABORT_ON_ERROR)
    return flags | (libvirt.VIR_MIGRATE_POSTCOPY if postcopy else libvirt.VIR_MIGRATE_AUTO_CONVERGE)


def migrate_params(route: Routes, prep: dict[str, Any], targets: list[str], postcopy: bool) -> dict[str, Any]:
    """libvirt's parameters for a live move to what the other host prepared (``prep``). Without post-copy,
    auto-converge starts at :data:`THROTTLE_INITIAL` and adds :data:`THROTTLE_INCREMENT`: each round a guest
    spends outrunning a slow link re-sends what it wrote, so the fewer such rounds the fewer bytes (B2-live at
    8 Mbit/s with a 2 MiB/s dirtier: 23 rounds and 97 MB of memory on the link at QEMU's 20 and 10). A guest
    whose rounds shrink by themselves is never throttled."""
    params: dict[str, Any] = {libvirt.VIR_MIGRATE_PARAM_DEST_XML: str(prep["xml"]),
                              libvirt.VIR_MIGRATE_PARAM_DEST_NAME: str(prep["domain"]),
                              libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS: targets,
                              libvirt.VIR_MIGRATE_PARAM_URI: route.migration_uri,
                              libvirt.VIR_MIGRATE_PARAM_DISKS_URI: route.disks_uri}
    if not postcopy:
        params[libvirt.VIR_MIGRATE_PARAM_AUTO_CONVERGE_INITIAL] = THROTTLE_INITIAL
        params[libvirt.VIR_MIGRATE_PARAM_AUTO_CONVERGE_INCREMENT] = THROTTLE_INCREMENT
    return params


def _switchover(dom: libvirt.virDomain, tunnels: Tunnels) -> SwitchoverRate:
    """The switchover rate of the migration channel, from two counters: the bytes QEMU has written into it so far
    (before the memory codec) less the pages the codec sent as references, and the bytes that left for the link.
    What remains at the switchover is pages the guest has just written, which the other host does not hold, so
    only the flow of such pages tells what the pause can carry (B2-live's commute case at 384 kbit/s, most pages
    references: QEMU was told 2.5 MB/s and paused 9.2 s)."""
    t = tunnels.tunnels.get("qemu-migration")
    if t is None:
        return SwitchoverRate(dom, lambda: 0)
    wire = lambda: t.bytes_sent  # noqa: E731
    return SwitchoverRate(dom, (lambda: t.memory.literal_bytes) if tunnels.dedup else wire, wire=wire)


def _run_job(dom: libvirt.virDomain, route: Routes, prep: dict[str, Any], targets: list[str], max_pause: float,
             postcopy: bool, tracker: Tracker, cancel: CancelToken, say: Callable[[str], None],
             link: Callable[[], int], switchover: SwitchoverRate, recover_timeout: float,
             listen_there: Callable[[], object]) -> LiveFigures:
    """libvirt's migration in a thread, its job watched: progress, cancel, switchover, post-copy; a post-copy whose
    link breaks is resumed when it returns (:mod:`capsule.migrate.recover`)."""
    flags = migrate_flags(postcopy)
    params = migrate_params(route, prep, targets, postcopy)
    dom.migrateSetMaxDowntime(qemu_downtime_ms(max_pause), 0)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            dom.migrateToURI3(route.libvirt_uri, params, flags)
        except BaseException as exc:  # noqa: BLE001 - handed to the watching thread
            errors.append(exc)

    tracker.enter("memory", "sending memory while the guest runs")
    t0 = time.monotonic()
    worker = threading.Thread(target=run, name="live-migrate", daemon=True)
    worker.start()
    figures = jobwatch.watch(dom, worker, postcopy, tracker, cancel, say, errors, link, switchover)
    if errors and figures.postcopy and postcopy_failed(dom, incoming=False):
        detail = _detail(errors[0])
        figures.link_breaks += 1
        say(f"the link broke during post-copy ({detail}): the guest waits at the other host for its last pages; "
            f"resuming when the link returns (at most {recover_timeout:.0f} s)")
        tracker.note(f"the link broke during post-copy: waiting up to {recover_timeout:.0f} s for it to return")
        recover.resume(dom, lambda: recover.attempt(dom, route.migration_uri, listen_there, say),
                       timeout=recover_timeout, say=say,
                       watch=lambda w, errs: jobwatch.watch(dom, w, True, tracker, cancel, say, errs, link, switchover,
                                                    figures))
        errors.clear()
    figures.seconds = time.monotonic() - t0
    if errors:
        exc = errors[0]
        if cancel.cancelled and not cancel.committed:
            raise Cancelled("the migration was cancelled") from exc
        raise RuntimeFailure(f"libvirt's migration failed: {_detail(exc)}") from exc
    return figures


def _detail(exc: BaseException) -> str:
    return exc.get_error_message() if isinstance(exc, libvirt.libvirtError) else str(exc)


def _end_here(store: Store, inst: Any) -> None:
    """The guest runs at the other host: this host's instance ends (its leaves since T0 are dropped)."""
    dom = lookup_domain(inst.domain)
    if dom is not None:
        with contextlib.suppress(libvirt.libvirtError):
            dom.destroy()
    with store.lock(timeout=None, purpose=f"ending {inst.capsule} here after its live move"):
        with store.catalogue.transaction():
            store.catalogue.delete_instance(inst.capsule)
        for leaf in inst.leaves:
            Path(leaf).unlink(missing_ok=True)
        shutil.rmtree(inst.dir, ignore_errors=True)


def runs_here(store: Store, name: str) -> bool:
    """After a failed move: whether the guest still runs here (a guest libvirt left paused before post-copy
    is resumed)."""
    inst = store.catalogue.instance(name)
    dom = lookup_domain(inst.domain) if inst is not None else None
    if dom is None or not dom.isActive():
        return False
    state, reason = dom.state()
    if state == libvirt.VIR_DOMAIN_PAUSED and reason != libvirt.VIR_DOMAIN_PAUSED_POSTCOPY:
        with contextlib.suppress(libvirt.libvirtError):
            dom.resume()
    return True


def phases(postcopy: bool) -> tuple[str, ...]:
    return planned("live", postcopy)


__all__ = ["LiveFigures", "LiveRefused", "Moved", "Routes", "Snapshot", "move", "phases"]
