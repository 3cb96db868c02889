"""The fleet's members: peers of this host (``capsule/hosts.py`` keeps their URL, token and store id)
that belong to a group. ``fleet add`` adds the peer first when it is not known yet, so the URL and token
checks and the ``/v1/info`` probe are the peers' own; a fleet member is a peer with a group."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Any

from capsule import hosts
from capsule.errors import AlreadyExists, Conflict, NotFound
from capsule.names import check_name
from capsule.store import Store

DEFAULT_GROUP = "default"


@dataclass(frozen=True)
class Member:
    peer: hosts.Peer
    group: str
    added: float
    last_seen: float | None

    @property
    def name(self) -> str:
        return self.peer.name

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.peer.name, "url": self.peer.url, "group": self.group, "added": self.added,
                "last_seen": self.last_seen}


def members(store: Store, group: str | None = None, names: list[str] | None = None) -> list[Member]:
    """The members (of ``group``; only those in ``names``), by host name. Unknown names or an empty
    group are errors: a rollout to nobody is a mistake."""
    if group is not None:
        check_name(group, "group")
    for n in names or []:
        check_name(n, "host")
    by_name = {p.name: p for p in hosts.peers(store)}
    rows = store.catalogue.query("SELECT * FROM fleet_members ORDER BY host")
    out = [Member(by_name[r["host"]], r["grp"], r["added"], r["last_seen"]) for r in rows if r["host"] in by_name]
    if names:
        known = {m.name for m in out}
        if unknown := [n for n in names if n not in known]:
            raise NotFound(f"not in the fleet: {', '.join(unknown)} (see `capsule fleet ls`)")
        out = [m for m in out if m.name in names]
    if group is not None:
        out = [m for m in out if m.group == group]
        if not out:
            raise NotFound(f"the fleet has no host in group {group!r} (see `capsule fleet ls`)")
    return out


def get(store: Store, host: str) -> Member:
    return members(store, names=[host])[0]


def add(store: Store, host: str, url: str, token: str, group: str = DEFAULT_GROUP, *,
        fingerprint: str | None = None) -> Member:
    """Put ``host`` in the fleet's ``group``. A host not known yet is added as a peer (its agent must
    answer with the token; over https its certificate must have ``fingerprint``, or be CA-signed); a known
    one must be at the same URL."""
    check_name(host, "host")
    check_name(group, "group")
    url = hosts.check_url(url)
    try:
        peer = hosts.get(store, host)
    except NotFound:
        peer = hosts.add(store, host, url, token, fingerprint=fingerprint)
    else:
        if peer.url != url:
            raise Conflict(f"host {host!r} is known at {peer.url}, not {url} (`capsule host rm {host}` first)")
        if not hmac.compare_digest(peer.token.encode(), token.encode()):
            raise Conflict(f"host {host!r} is known with another token (`capsule host rm {host}` and add it "
                           "again if its token changed)")
    cat = store.catalogue
    with store.lock(), cat.transaction():
        if cat.query("SELECT 1 FROM fleet_members WHERE host=?", (host,)):
            raise AlreadyExists(f"host {host!r} is already in the fleet (`capsule fleet rm {host}` first)")
        now = time.time()
        cat.query("INSERT INTO fleet_members VALUES(?,?,?,?)", (host, group, now, now))
    return Member(peer, group, now, now)


def remove(store: Store, host: str) -> Member:
    """Take ``host`` out of the fleet (it stays a known peer; nothing on it changes)."""
    member = get(store, host)
    cat = store.catalogue
    with store.lock(), cat.transaction():
        cat.query("DELETE FROM fleet_members WHERE host=?", (host,))
    return member


def seen(store: Store, answered: dict[str, float]) -> None:
    """Record when hosts last answered."""
    if not answered:
        return
    cat = store.catalogue
    with store.lock(), cat.transaction():
        for host, t in answered.items():
            cat.query("UPDATE fleet_members SET last_seen=? WHERE host=?", (t, host))
