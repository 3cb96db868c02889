"""``capsule fleet status``: per host and fleet capsule, the versions it holds and the one it runs,
and when the host last answered (asked of all hosts at once, within one deadline)."""

from __future__ import annotations

import time
from typing import Any

from capsule.fleet import hostops, members
from capsule.fleet.push import fleet_capsules
from capsule.store import Store


def status(store: Store, group: str | None = None, timeout: float = hostops.ASK_TIMEOUT) -> dict[str, Any]:
    """Plain data: {"capsules": {name: target version}, "hosts": [...]} (one row per host)."""
    chosen = members.members(store, group)
    targets = fleet_capsules(store)
    views = hostops.survey(store, chosen, timeout) if chosen else {}
    now = time.time()
    members.seen(store, {h: v.answered_at for h, v in views.items() if v.answered_at})
    rows = []
    for m in chosen:
        v = views[m.name]
        caps = {}
        for name, target in targets.items():
            held = v.capsules.get(name, {}).get("versions", []) if v.reachable else None
            caps[name] = {"target": target, "holds": held,
                          "running": v.running(name) if v.reachable else None,
                          "current": None if held is None else target in held}
        rows.append({"host": m.name, "group": m.group, "url": m.peer.url, "reachable": v.reachable,
                     "error": v.error, "last_seen": now if v.reachable else m.last_seen, "capsules": caps})
    return {"capsules": targets, "hosts": rows}
