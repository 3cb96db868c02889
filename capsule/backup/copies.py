"""Off-host copies (``--to HOST``; ``--to s3://…``, a repository: :mod:`capsule.repo.backups`): after each run, every
backup of the capsule not yet on the backup host is pushed there with HCP (``transfer.push``: only the blocks that
host lacks travel), oldest first. Which backups are there is kept in a table of its own. If the host is down the
copies wait for the next run; the local backups are untouched either way. A backup pruned here before it was copied
is not copied. After the copies the backup host applies its own policy (the job's ``--to-keep``, or the same as
here)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from capsule import hosts, transfer
from capsule.agentclient import AgentClient
from capsule.backup import jobs
from capsule.backup.retention import Policy
from capsule.errors import Error
from capsule.repo import backups as repo_backups
from capsule.store import Store
from hashcache.hcp import ProtocolError


@dataclass
class CopyResult:
    target: str
    copied: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    wire_bytes: int = 0
    pruned: list[int] = field(default_factory=list)   # removed there by its policy
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def copied(store: Store, name: str, target: str) -> set[int]:
    """The backups copied to ``target`` once (pruned there since or not: never sent again)."""
    rows = store.catalogue.query("SELECT number FROM backup_copies WHERE capsule=? AND target=?",
                                         (name, target))
    return {r["number"] for r in rows}


def copied_to(store: Store, name: str) -> dict[str, set[int]]:
    """Every backup host that holds copies of ``name``'s backups, with the numbers it still holds."""
    out: dict[str, set[int]] = {}
    for r in store.catalogue.query("SELECT target, number FROM backup_copies WHERE capsule=? AND "
                                           "pruned IS NULL", (name,)):
        out.setdefault(r["target"], set()).add(r["number"])
    return out


def prune_there(store: Store, name: str, target: str, policy: Policy) -> list[int]:
    """Apply ``policy`` to the copies on ``target`` (its agent prunes, then collects what nothing there
    uses); the copies it removed are remembered, so they are neither sent again nor verified there."""
    if repo_backups.is_repository(target):
        return repo_backups.prune_there(store, name, target, policy)
    peer = hosts.get(store, target)
    with AgentClient(peer.url, peer.token, fingerprint=peer.fingerprint) as client:
        answer = client.post_json(f"/v1/backups/{name}/prune", {"policy": policy.as_dict()})
    try:
        removed = [int(n) for n in answer["removed"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"{target} answered the prune with something unusable: {str(answer)[:200]}") from exc
    for n in removed:
        store.catalogue.query("UPDATE backup_copies SET pruned=? WHERE capsule=? AND number=? AND target=?",
                              (time.time(), name, n, target))
    return removed


def push_pending(store: Store, name: str, target: str) -> CopyResult:
    """Push every backup of ``name`` the host ``target`` does not have yet; stop at the first failure."""
    result = CopyResult(target)
    done = copied(store, name, target)
    todo = [v for v in jobs.backups(store, name) if v.number not in done]
    if repo_backups.is_repository(target):
        repo_backups.push_pending(store, name, target, result, todo)
        return result
    try:
        peer = hosts.get(store, target)
    except Error as exc:
        result.error, result.waiting = str(exc), [v.number for v in todo]
        return result
    for i, v in enumerate(todo):
        try:
            report = transfer.push(store, v.ref, peer.url, peer.token)
        except (Error, OSError) as exc:
            result.error = f"copy of {v.ref} to {target} failed: {exc}; retried at the next run"
            result.waiting = [w.number for w in todo[i:]]
            return result
        store.catalogue.query("INSERT OR REPLACE INTO backup_copies(capsule, number, target, copied, wire_bytes) "
                              "VALUES(?,?,?,?,?)", (name, v.number, target, time.time(), report.wire_bytes))
        result.copied.append(v.number)
        result.wire_bytes += report.wire_bytes
    return result
