"""Grants: a capability this host hands a peer for one job, never a role.

A grant allows one of two things, on one target:

- ``read``: pull the objects of one capsule (or of one version of it) — HCP LOOKUP, READ-HASH and READ of an
  object one of those versions references (the layers of its disk chains, its memory image, kernel and initrd:
  :func:`capsule.transfer.records.objects_of`), that version's record, ``/v1/info``. What a fleet host pulls a version
  with, and what a demand run's destination pages the disks in with;
- ``push``: receive one push of one version — the objects its record references, then that record and no other.

A grant never makes grants, records another version, prunes, touches pods, starts or stops anything, or calls
the dashboard's API: :mod:`capsule.agent.authz` serves it only on the routes its ``RULES`` name for its
capability, and checks the target there. Every grant expires (at most :data:`MAX_GRANT_SECONDS` when asked for
over the network), records who made it, and ends with that user or token (:mod:`capsule.accounts.tokens`); the
peer ends it itself when its job is done (``DELETE /v1/grants/self``)."""

from __future__ import annotations

import os
import pwd
import re
import threading
from collections import OrderedDict
from typing import Any

from capsule import __version__
from capsule.accounts import tokens, users
from capsule.accounts.model import CAPABILITIES, PUSH, READ, Grant, Principal
from capsule.bounds import GRANT_SECONDS, check
from capsule.errors import Forbidden, InvalidName, NotFound
from capsule.names import check_name
from capsule.store import Store
from capsule.transfer.records import objects_of, validate, version_record
from hashcache.errors import ProtocolMismatch
from hashcache.transport import protocol

MAX_GRANT_SECONDS = GRANT_SECONDS.hi  # a grant asked for over the network lives at most a day
DEFAULT_SECONDS = 3600.0
# A demand run's grant ends when the run stops or no longer depends on its source (its destination ends it);
# this is the backstop for a destination that never says so: three days, in which prefetch brings a 10 GB
# disk even over the slowest link the benchmarks shape (384 kbit/s moves ~12 GB in 72 h).
DEMAND_RUN_SECONDS = 72 * 3600.0
_ID = re.compile(r"cap_([0-9a-f]{12})_")
USAGE = ('a grant request names what it allows: {"allow": "read", "capsule": NAME, "version": V (optional), '
         '"expires_in": SECONDS} or {"allow": "push", "record": VERSION_RECORD, "expires_in": SECONDS}')


def issuer_of(principal: Principal) -> tuple[str, str | None]:
    """Who makes a grant on behalf of ``principal``: (user name or the old host token, its token id)."""
    if principal.grant is not None:
        raise Forbidden("a grant cannot make grants")
    if principal.user is None:
        return tokens.LEGACY_ISSUER, None
    return principal.user, principal.token_id


def local_issuer() -> str:
    """The issuer of a grant made by this host's own command line: ``unix:NAME``."""
    try:
        return "unix:" + pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return f"unix:{os.getuid()}"


def _seconds(value: Any) -> float:
    return float(check(GRANT_SECONDS, value, "expires_in"))     # the one rule for numbers from the network


def read_grant(store: Store, capsule: str, version: int | None, *, issuer: str, issuer_token: str | None = None,
               expires_in: float = DEFAULT_SECONDS) -> str:
    """A grant to read the objects of ``capsule`` (of ``capsule@version`` only, if given): the token."""
    check_name(capsule)
    cap = store.catalogue.capsule(capsule)
    if cap is None:
        raise NotFound(f"no capsule named {capsule!r} on this host: nothing to grant")
    if version is not None and store.catalogue.version(capsule, version) is None:
        raise NotFound(f"no version {capsule}@{version} on this host: nothing to grant")
    return tokens.insert_grant(store, Grant(READ, capsule, version, issuer, issuer_token, uuid=cap.uuid), expires_in)


def push_grant(store: Store, record: Any, *, issuer: str, issuer_token: str | None = None,
               expires_in: float = DEFAULT_SECONDS) -> str:
    """A grant to receive the version ``record`` describes (its objects, then that record): the token."""
    validate(record)
    return tokens.insert_grant(store, Grant(PUSH, record["capsule"], record["number"], issuer, issuer_token,
                                            record=record), expires_in)


def _version_of(req: dict[str, Any]) -> int | None:
    v = req.get("version")
    if v is not None and (type(v) is not int or not 0 < v < 10**9):
        raise InvalidName(f"a grant's version is a version number, not {v!r}")
    return v


def request(store: Store, principal: Principal, req: Any, peer: protocol.Peer | None = None) -> dict[str, Any]:
    """``POST /v1/grants/host``: a grant for a third host, asked for by a user allowed host calls here (a fleet
    rollout's origin, for the host that pulls a version from this one). Refused without what it allows; a caller
    of protocol 1 (0.1.0), which asks for a grant of any host call, is told that this release gives none."""
    if isinstance(req, dict) and "allow" not in req and peer is not None and peer.protocol < 2:
        raise ProtocolMismatch(
            f"the caller is {peer} and asks for a host grant that allows every host call; this is capsule "
            f"{__version__} (protocol {protocol.PROTOCOL}), whose grants allow one job (reading one capsule, "
            "receiving one push): upgrade Capsule on the calling host")
    if not isinstance(req, dict) or req.get("allow") not in CAPABILITIES:
        raise InvalidName(USAGE)
    issuer, issuer_token = issuer_of(principal)
    seconds = _seconds(req.get("expires_in", DEFAULT_SECONDS))
    version = _version_of(req)
    if req["allow"] == READ:
        if not isinstance(req.get("capsule"), str):
            raise InvalidName(USAGE)
        token = read_grant(store, req["capsule"], version, issuer=issuer, issuer_token=issuer_token,
                           expires_in=seconds)
    else:
        record = req.get("record")
        if not isinstance(record, dict):
            raise InvalidName(USAGE)
        validate(record)
        if req.get("capsule", record["capsule"]) != record["capsule"] or version not in (None, record["number"]):
            raise InvalidName("a push grant's capsule and version are its record's")
        token = push_grant(store, record, issuer=issuer, issuer_token=issuer_token, expires_in=seconds)
    g = tokens.get(store, token.split("_")[1])
    assert g.grant is not None
    return {"token": token, "id": g.id, "expires": g.expires} | g.grant.as_dict()


def for_demand_run(store: Store, legacy: str | None, capsule: str, issuer: str,
                   issuer_token: str | None = None) -> str:
    """What a demand run's destination reads ``capsule``'s disks from this host with: the old host token while no
    admin exists, else a read grant for that capsule (its version is made by the migration's suspend, after
    this), expiring after :data:`DEMAND_RUN_SECONDS` unless the destination ends it first."""
    if legacy is not None and not users.admin_exists(store):
        return legacy
    return read_grant(store, capsule, None, issuer=issuer, issuer_token=issuer_token, expires_in=DEMAND_RUN_SECONDS)


def discard(store: Store, token: str | None) -> None:
    """Revoke ``token`` if it is a grant of this store (the job it was made for did not happen)."""
    m = _ID.match(token or "")
    if m is None:
        return
    try:
        t = tokens.get(store, m[1])
    except NotFound:
        return
    if t.grant is not None:
        tokens.revoke(store, t.id)


def end(store: Store, principal: Principal) -> dict[str, Any]:
    """``DELETE /v1/grants/self``: the grant making the call ends (its job is done); final."""
    if principal.grant is None or principal.token_id is None:
        raise Forbidden("only a grant ends itself; a user's token is revoked with `capsule token revoke ID`")
    t = tokens.revoke(store, principal.token_id)
    return {"revoked": t.id, "state": t.state()}


# -- what a grant covers -------------------------------------------------------------------------------------

class _Objects:
    """The objects of a read grant's target, looked up once and shared by every request thread: a version never
    changes, so a miss is final; for a capsule, a miss asks only which versions it has now (numbers and times,
    no records) and looks its objects up again if those changed."""

    def __init__(self, size: int = 256) -> None:
        self._lock = threading.Lock()
        self._by_target: OrderedDict[tuple[Any, ...], tuple[Any, frozenset[str], frozenset[str]]] = OrderedDict()
        self._size = size

    @staticmethod
    def _key(store: Store, g: Grant) -> tuple[Any, ...]:
        return str(store.home), g.capsule, g.version, g.uuid

    def peek(self, store: Store, g: Grant, kind: str, oid: str) -> bool | None:
        """From what was looked up already: True, False, or None when the catalogue must be asked."""
        with self._lock:
            entry = self._by_target.get(self._key(store, g))
        if entry is None:
            return None
        if oid in (entry[1] if kind == "layer" else entry[2]):
            return True
        return False if g.version is not None else None

    def look_up(self, store: Store, g: Grant, kind: str, oid: str) -> bool:
        key = self._key(store, g)
        stamp = None if g.version is not None else tuple(
            (r[0], r[1]) for r in store.catalogue.query(
                "SELECT number, created FROM versions WHERE capsule=? ORDER BY number", (g.capsule,)))
        with self._lock:
            entry = self._by_target.get(key)
        if entry is None or entry[0] != stamp:
            entry = (stamp, *_target_objects(store, g))
            with self._lock:
                self._by_target[key] = entry
                self._by_target.move_to_end(key)
                while len(self._by_target) > self._size:
                    self._by_target.popitem(last=False)
        return oid in (entry[1] if kind == "layer" else entry[2])


_objects = _Objects()


def _target_objects(store: Store, g: Grant) -> tuple[frozenset[str], frozenset[str]]:
    cat = store.catalogue
    cap = cat.capsule(g.capsule)
    if cap is None or (g.uuid is not None and cap.uuid != g.uuid):
        return frozenset(), frozenset()
    versions = cat.versions(g.capsule) if g.version is None else [v for v in [cat.version(g.capsule, g.version)] if v]
    layers: set[str] = set()
    files: set[str] = set()
    for v in versions:
        ls, fs = objects_of(version_record(store, v))
        layers.update(ls)
        files.update(f for f, _role in fs)
    return frozenset(layers), frozenset(files)


def readable(store: Store, g: Grant) -> tuple[frozenset[str], frozenset[str]]:
    """The objects (layer ids, file ids) whose blocks ``g`` may learn about on this host, held here or not: for
    a read grant, what it reads; for a push grant, what its record references and the objects of the versions
    here of the capsule it pushes to — only when that is the same capsule (its uuid is the record's: a capsule
    of another owner under the same name is not). What a push's receiver counts as held and rebuilds deltas
    against (:mod:`capsule.exchange.holdings`)."""
    if g.allow == READ:
        return _target_objects(store, g)
    assert g.record is not None
    layers, files = objects_of(g.record)
    out_layers, out_files = set(layers), {f for f, _role in files}
    cap = store.catalogue.capsule(g.capsule)
    uuid = g.record.get("uuid")
    if cap is not None and uuid is not None and cap.uuid == uuid:
        for v in store.catalogue.versions(g.capsule):
            ls, fs = objects_of({"chains": v.chains, "config": v.config, "memory": v.memory})
            out_layers.update(ls)
            out_files.update(f for f, _role in fs)
    return frozenset(out_layers), frozenset(out_files)


def covered(store: Store, g: Grant, kind: str, oid: str) -> bool | None:
    """Whether ``g`` reaches object ``kind``/``oid`` — for a read grant, one its versions reference; for a push
    grant, one its record references — from what is known without the catalogue; None: :func:`covers` must
    look it up (the block stream answers a cached hit without a thread hop)."""
    if kind not in ("layer", "file") or not isinstance(oid, str):
        return False
    if g.allow == PUSH:
        assert g.record is not None
        layers, files = objects_of(g.record)
        return oid in (layers if kind == "layer" else [f for f, _role in files])
    return _objects.peek(store, g, kind, oid)


def covers(store: Store, g: Grant, kind: str, oid: str) -> bool:
    """:func:`covered`, looking the grant's versions up in the catalogue when it must."""
    known = covered(store, g, kind, oid)
    return _objects.look_up(store, g, kind, oid) if known is None else known


def covers_version(store: Store, g: Grant, name: str, number: str) -> bool:
    """Whether ``g`` may read the record of ``name``'s version ``number`` (or ``latest``)."""
    if g.allow != READ or name != g.capsule:
        return False
    cap = store.catalogue.capsule(name)
    if cap is None or (g.uuid is not None and cap.uuid != g.uuid):
        return False
    if g.version is None:
        return True
    if number == "latest":
        latest = store.catalogue.latest_version(name)
        return latest is not None and latest.number == g.version
    return number == str(g.version)


def covers_record(g: Grant, record: Any) -> bool:
    """Whether ``g`` may record ``record``: a push grant, and exactly the record it was made for."""
    return g.allow == PUSH and record == g.record
