"""Coordinated checkpoint of a distributed application (ZapC §4): pods in one or more capsules of this host
that talk to each other over TCP, checkpointed as one consistent group and restarted together.

``checkpoint_group``: first every member's network is locked — its port on the capsule's pod bridge
disabled, so no frame goes in or out and none is answered with a reset; a segment in flight is lost on
the wire and stays unacknowledged in its sender's queue —, then all members are dumped at once (CRIU with
their TCP connections, queues included), and one **group image** is recorded: a sealed file object (role
``pod-group``) naming each member's pod image, capsule and address. ``restore_group`` restarts every
member (in its capsule, or where ``into`` says) at once; TCP then resends what the lock dropped, so a
conversation between members goes on with nothing lost and nothing repeated. Should a dump fail, the
members already dumped are restored where they were and the rest unlocked: the application runs on."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from capsule.errors import Error
from capsule.names import check_name as validate_capsule_name
from capsule.pod import POD_GROUP_ROLE, keep_sealed, ops
from capsule.pod.errors import PodFailed, PodNameInvalid, PodNotFound
from capsule.pod.relay import Relay
from capsule.store import Store
from pods.names import host_veth

GROUP_ROLE = POD_GROUP_ROLE
T = TypeVar("T")
GROUP_FORMAT = 1


def _per_capsule(where: dict[str, str], work: Callable[[str], T]) -> dict[str, T | Error]:
    """``work(key)`` for every key, the capsules (``where[key]``) at once, a capsule's keys one after the
    other (one guest agent takes one connection at a time). A key's typed error is its result."""
    by_capsule: dict[str, list[str]] = {}
    for key, capsule in where.items():
        by_capsule.setdefault(capsule, []).append(key)
    results: dict[str, T | Error] = {}

    def run(keys: list[str]) -> None:
        for key in keys:
            try:
                results[key] = work(key)
            except Error as exc:
                results[key] = exc

    with ThreadPoolExecutor(len(by_capsule)) as pool:
        for f in [pool.submit(run, keys) for keys in by_capsule.values()]:
            f.result()
    return results


def _lock(store: Store, capsule: str, pod: str, up: bool) -> None:
    """Stop (or resume) every frame to and from the pod at its port on the capsule's pod bridge: the port
    disabled (state 0) or forwarding (3). The link stays up — taking it down would mark the pod's routes
    ``linkdown``, which CRIU then fails to restore."""
    Relay(store, capsule).sh(f"bridge link set dev {host_veth(pod)} state {3 if up else 0}")


def checkpoint_group(store: Store, refs: list[str]) -> dict[str, Any]:
    t0 = time.monotonic()
    members = [ops.parse_ref(r) for r in refs]
    if len(members) < 2:
        raise PodNameInvalid("a group checkpoint takes two pods or more (for one: capsule pod checkpoint)")
    if len(set(members)) != len(members):
        raise PodNameInvalid("a pod is named twice in the group")
    if len({pod for _c, pod in members}) != len(members):
        raise PodNameInvalid("two members share a pod name: a group's pods are restored by name")
    found = {ref: ops.source_pod(store, ref) for ref in refs}  # every member runs (or PodNotFound)
    locked: list[tuple[str, str]] = []
    t_lock = time.monotonic()
    try:
        for capsule, pod in members:
            _lock(store, capsule, pod, up=False)
            locked.append((capsule, pod))
    except Error:
        for capsule, pod in locked:
            _lock(store, capsule, pod, up=True)
        raise
    lock_seconds = time.monotonic() - t_lock
    outcome = _per_capsule({ref: ops.parse_ref(ref)[0] for ref in refs}, lambda ref: ops.checkpoint(store, ref))
    done = {ref: r for ref, r in outcome.items() if not isinstance(r, Error)}
    failed = {ref: r for ref, r in outcome.items() if isinstance(r, Error)}
    if failed:
        for ck in done.values():  # the dumped ones run again where they were, the others are unlocked
            ops.restore(store, ck.image, ck.capsule)
        for ref in failed:
            capsule, pod = ops.parse_ref(ref)
            _lock(store, capsule, pod, up=True)
        ref, exc = next(iter(failed.items()))
        raise PodFailed(f"group checkpoint: {ref} could not be dumped ({exc}); every member runs on "
                        "where it was") from exc
    record = {"format": GROUP_FORMAT, "made": time.time(),
              "members": [{"capsule": done[r].capsule, "pod": done[r].pod, "ip": found[r]["ip"],
                           "image": done[r].image, "size": done[r].size} for r in refs]}
    tmp = store.temp_path(".pod-group.json")
    try:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        row = keep_sealed(store, tmp, GROUP_ROLE)
    finally:
        tmp.unlink(missing_ok=True)
    return {"group": row.id, "members": record["members"], "lock_seconds": round(lock_seconds, 3),
            "dump_seconds": round(max(ck.seconds for ck in done.values()), 3),
            "seconds": round(time.monotonic() - t0, 3)}


def read_group(store: Store, ref: str) -> dict[str, Any]:
    """A group image by its id or a unique prefix (≥ 6 hex digits), parsed and checked."""
    if len(ref) < 6 or any(c not in "0123456789abcdef" for c in ref):
        raise PodNameInvalid(f"{ref!r}: a group image is named by its id (at least 6 hex digits)")
    hits = [f.id for f in store.catalogue.files() if f.role == GROUP_ROLE and f.id.startswith(ref)]
    if len(hits) != 1:
        raise (PodNotFound(f"no group image {ref!r} in this store (`capsule pod checkpoint-group` makes one)")
               if not hits else PodNameInvalid(f"{ref!r} names {len(hits)} group images; give more digits"))
    try:
        record = json.loads(store.file_path(hits[0]).read_text())
        members = record["members"]
        assert record["format"] == GROUP_FORMAT and isinstance(members, list) and members
        for m in members:
            validate_capsule_name(m["capsule"])
            ops.check_pod_name(m["pod"])
            ops.resolve_image(store, m["image"])
    except (OSError, ValueError, KeyError, TypeError, AssertionError, Error) as exc:
        raise PodFailed(f"group image {hits[0][:12]} is malformed or names what is not here: {exc}") from exc
    return {"id": hits[0], **record}


def restore_group(store: Store, ref: str, into: dict[str, str] | None = None) -> dict[str, Any]:
    """Restart every member of a group image at once: each in its own capsule, or in ``into[pod]``."""
    t0 = time.monotonic()
    group = read_group(store, ref)
    into = into or {}
    unknown = set(into) - {m["pod"] for m in group["members"]}
    if unknown:
        raise PodNotFound(f"group image {group['id'][:12]} has no pod {sorted(unknown)[0]!r}")
    for capsule in set(into.values()):
        validate_capsule_name(capsule)
    targets = {m["pod"]: into.get(m["pod"], m["capsule"]) for m in group["members"]}
    images = {m["pod"]: m["image"] for m in group["members"]}
    outcome = _per_capsule(targets, lambda pod: ops.restore(store, images[pod], targets[pod]))
    failed = {pod: r for pod, r in outcome.items() if isinstance(r, Error)}
    if failed:
        for pod, r in outcome.items():  # all or none: the group image stays, to be restored again
            if not isinstance(r, Error):
                ops.kill(store, f"{targets[pod]}/{pod}")
        pod, exc = next(iter(failed.items()))
        raise PodFailed(f"group restore: {pod} could not be restored in {targets[pod]!r} ({exc}); none of "
                        f"the group runs, its image {group['id'][:12]} is kept") from exc
    restored = [r for r in (outcome[m["pod"]] for m in group["members"]) if not isinstance(r, Error)]  # (none failed)
    return {"group": group["id"], "members": [{"pod": r["name"], "capsule": r["capsule"], "ip": r["ip"],
                                                "state": r["state"]} for r in restored],
            "seconds": round(time.monotonic() - t0, 3)}
