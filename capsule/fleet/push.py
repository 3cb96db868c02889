"""``capsule fleet push NAME@V`` and ``fleet rollback NAME@V``: check everything first (the
version here, the hosts, their tokens), then plan the stages and run them.

Nothing is sent to any host unless every check passes: an unknown version, group or host, or a host
that refuses the token (or answers as another store) stops the rollout before its first byte. A host
that does not answer is only ``offline``: it is skipped and gets the version on the next run.

``--via REPO`` (:mod:`capsule.fleet.via`): the repository is opened before any host is asked (a wrong
passphrase or an unreachable store stops it there), the origin stores the version in it once, and the hosts
that get it from no peer restore it from the repository: the origin sends nothing to any host."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from capsule import transfer
from capsule.capsules import resolve
from capsule.errors import AuthFailed, Conflict, InvalidName, NotFound, PeerError
from capsule.fleet import hostops, members
from capsule.fleet.fanout import ORIGIN, REPOSITORY
from capsule.fleet.plan import Plan, plan_stages
from capsule.fleet.rollout import HostResult, Outcome, Rollout
from capsule.fleet.via import Via
from capsule.names import parse_ref
from capsule.store import Store
from capsule.store.catalogue import Catalogue, VersionRow


@dataclass
class PushOptions:
    group: str | None = None
    hosts: list[str] | None = None
    canary: int = 0
    waves: list[int] | None = None
    max_failures: int = 0
    parallel: int = 4
    fanout: bool = True
    activate: bool = False
    timeout: float = hostops.ASK_TIMEOUT
    via: str | None = None                                  # a repository URL: hosts restore from it
    via_secret: bytes | None = field(default=None, repr=False)   # what opens its key (passphrase, key file)


@dataclass
class PushReport:
    ref: str
    plan: Plan
    outcome: Outcome
    seconds: float
    via: dict[str, Any] | None = None     # a rollout --via: the repository and what the origin sent it

    def as_dict(self) -> dict[str, Any]:
        out = {"version": self.ref, "stages": [{"name": s.name, "hosts": list(s.hosts)} for s in self.plan.stages],
               "held_back": list(self.plan.held_back), "seconds": round(self.seconds, 3)} | self.outcome.as_dict()
        return out | ({"via": self.via} if self.via is not None else {})


def fleet_capsules(store: Store) -> dict[str, int]:
    """Capsules pushed to the fleet and the version last pushed."""
    cat = store.catalogue
    return {r["name"]: r["version"] for r in cat.query("SELECT * FROM fleet_capsules ORDER BY name")}


def _remember(cat: Catalogue, name: str, version: int) -> None:
    with cat.transaction():
        cat.query("INSERT OR REPLACE INTO fleet_capsules VALUES(?,?,?)", (name, version, time.time()))


def _refuse_bad_hosts(views: dict[str, hostops.HostView]) -> None:
    """A host that answers but refuses the token, or answers as another store, is a mistake to fix
    before anything is sent; a silent one is only offline."""
    bad = {h: v for h, v in views.items() if not v.reachable and v.error_code not in (None, "unreachable")}
    auth = [h for h, v in bad.items() if v.error_code == AuthFailed.code]
    if auth:
        raise AuthFailed(f"host(s) {', '.join(sorted(auth))} refused the token: nothing was sent to any host "
                         "(`capsule fleet rm HOST` and add it again with the right --token-file)")
    if bad:
        detail = "; ".join(f"{h}: {v.error}" for h, v in sorted(bad.items()))
        raise PeerError(f"host(s) answered with an error, nothing was sent to any host: {detail}")


def push(store: Store, ref: str, opts: PushOptions,
         on_event: Callable[[HostResult], None] = lambda _r: None,
         transfer_opts: transfer.Options | None = None) -> PushReport:
    """Roll ``NAME@V`` out to the fleet (or its ``group``/``hosts``)."""
    t0 = time.monotonic()
    r = parse_ref(ref)
    if r.version is None:
        raise InvalidName(f"name the version to roll out: {r.name}@V (see `capsule versions {r.name}`)")
    version = resolve(store, ref)  # NotFound here: nothing is sent
    chosen = members.members(store, opts.group, opts.hosts)
    if not chosen:
        raise NotFound("the fleet has no hosts yet: `capsule fleet add HOST URL --token-file F`")
    plan = plan_stages([m.name for m in chosen], opts.canary, opts.waves)
    if opts.via is None:
        return _push(store, version, chosen, plan, opts, on_event, transfer_opts, None, t0)
    if not opts.via_secret:
        raise AuthFailed(f"--via {opts.via}: no secret to open the repository with (a passphrase or --key-file)")
    via = Via.open(opts.via, opts.via_secret)      # a wrong passphrase, no store: refused before any host
    try:
        return _push(store, version, chosen, plan, opts, on_event, transfer_opts, via, t0)
    finally:
        via.close()


def _push(store: Store, version: VersionRow, chosen: list[members.Member], plan: Plan, opts: PushOptions,
          on_event: Callable[[HostResult], None], transfer_opts: transfer.Options | None, via: Via | None,
          t0: float) -> PushReport:
    views = hostops.survey(store, chosen, opts.timeout)
    _refuse_bad_hosts(views)
    members.seen(store, {h: v.answered_at for h, v in views.items() if v.answered_at})
    by_name = {m.name: m for m in chosen}
    offline = {h: v.error or "no answer" for h, v in views.items() if not v.reachable}
    claimed = {h for h, v in views.items() if v.reachable and v.holds(version.capsule, version.number)}
    conflicting = hostops.other_content(store, version, [by_name[h] for h in sorted(claimed)])
    already = claimed - set(conflicting)
    if via is not None and any(h not in already and h not in offline and h not in conflicting for h in plan.hosts()):
        via.upload(store, version.ref)      # the origin's one upload: only the blocks the repository lacks
    _remember(store.catalogue, version.capsule, version.number)

    def send(host: str, source: str, on_bytes: Callable[[int], None]) -> int:
        if host in conflicting:
            raise Conflict(conflicting[host])
        if source == REPOSITORY and via is not None:
            return via.restore_on(by_name[host], version.ref)
        if source == ORIGIN:
            return hostops.push_from_origin(store, version.ref, by_name[host], on_bytes, transfer_opts)
        return hostops.pull_from_peer(version.ref, by_name[host], by_name[source],
                                      transfer_opts.level if transfer_opts else None, grant_of(source))

    grants: dict[str, str] = {}
    grants_lock = threading.Lock()

    def grant_of(source: str) -> str:
        """One read grant for the version per source host and rollout (asked for once, shared by its pulls)."""
        with grants_lock:
            if source not in grants:
                grants[source] = hostops.host_grant(by_name[source], version.capsule, version.number)
            return grants[source]

    def activate(host: str) -> str:
        running = views[host].running(version.capsule)
        if running is None:
            return f"{version.capsule} does not run here: nothing to replace"
        if running == version.number:
            return f"{version.ref} already runs"
        return hostops.activate(by_name[host], version.capsule, version.number)

    # fan-out sources: hosts that hold it and answered, in the plan's order
    holders = [h for h in plan.hosts() if h in already]
    rollout = Rollout(plan, transfer=send, activate=activate if opts.activate else None, offline=offline,
                      already=already, holders=holders, parallel=opts.parallel, fanout=opts.fanout,
                      max_failures=opts.max_failures, on_event=on_event,
                      last_resort=ORIGIN if via is None else REPOSITORY)
    outcome = rollout.run()
    members.seen(store, {res.host: time.time() for res in outcome.results if res.state in ("done", "already")})
    return PushReport(version.ref, plan, outcome, time.monotonic() - t0, via.report() if via else None)


def rollback(store: Store, name: str, to: str, opts: PushOptions,
             on_event: Callable[[HostResult], None] = lambda _r: None) -> PushReport:
    """Put ``name@V`` back on the fleet: sent where it is missing, and started in place of another
    version wherever one runs (rollback always activates). ``to`` is ``@V`` or ``V``."""
    text = to[1:] if to.startswith("@") else to
    ref = f"{name}@{text}"
    if parse_ref(ref).version is None:
        raise InvalidName(f"--to needs a version, like @2 (not {to!r})")
    opts.activate = True
    return push(store, ref, opts, on_event)
