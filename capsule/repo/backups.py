"""Scheduled backups copied to a repository (``capsule backup schedule NAME … --to s3://…``): after each run
every backup of the capsule not yet in the repository is pushed there (only the blocks it lacks are
uploaded), the job's ``--to-keep`` policy is applied to the capsule's versions there (forget, then prune),
and ``backup verify`` checks the repository (``repo check --read-data``).

The agent (or the CLI) running the job opens the repository with ``CAPSULE_REPO_KEY_FILE`` (a key file's
path) or ``CAPSULE_REPO_PASSPHRASE`` from its environment, and reads the S3 credentials as ``repo`` does;
neither is ever written into the store."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from capsule.errors import Conflict, Error
from capsule.repo import crypto, maintain
from capsule.repo.push import push
from capsule.repo.repository import Repository, connect
from capsule.repo.s3 import parse_url

SCHEMES = ("s3://", "s3+http://")


def is_repository(target: str | None) -> bool:
    return target is not None and target.startswith(SCHEMES)


def check_target(url: str) -> str:
    """The URL, checked (InvalidName if malformed); the repository itself is opened at the first copy."""
    return parse_url(url).url


@dataclass
class RestoredFrom:
    """A backup restored from a repository: what came from there, and the restore (``backup.runner.Restored``)."""

    url: str
    live: bool
    brought: Any              # repo.restore.RestoreReport (whole) or repo.instant.InstantReport (live)
    restored: Any             # backup.runner.Restored

    def as_dict(self) -> dict[str, Any]:
        b = self.brought
        return {**self.restored.as_dict(), "from": self.url, "live": self.live,
                "downloaded_bytes": b.downloaded_bytes, "remote_layers": getattr(b, "remote_layers", [])}


def restore_from(store: Any, ref: str, repo: Repository, *, as_name: str | None = None, live: bool = False,
                 say: Callable[[str], None] = lambda _m: None) -> RestoredFrom:
    """``capsule backup restore NAME@V --from REPO``: the backup's version comes from the repository, then it is
    restored as ``backup restore`` restores one held here (as the capsule's new latest version, or ``as_name``).
    Whole: every object the store lacks is downloaded first. ``live``: only its kernel, initrd and memory image
    are, its disks are paged in from the repository as the guest reads them and the rest is prefetched (the
    agent localizes it); if the start fails the repository's key leaves this host again."""
    from capsule.backup import runner
    from capsule.lifecycle import demand
    from capsule.repo import instant
    from capsule.repo.restore import restore as bring_whole

    if not live:
        whole = bring_whole(store, ref, repo, say)
        return RestoredFrom(repo.location.url, False, whole,
                            runner.restore(store, whole.version, as_name=as_name, say=say))
    prepared = instant.prepare(store, ref, repo, say)
    try:
        restored = runner.restore(store, prepared.version, as_name=as_name, prefetch=True, say=say)
    except BaseException:
        demand.release_sources(store, {prepared.url: None})   # no run reads from it: its key leaves this host
        raise
    return RestoredFrom(prepared.url, True, prepared, restored)


def open_for_jobs(url: str) -> Repository:
    return Repository.open(connect(url), crypto.read_secret(os.environ.get("CAPSULE_REPO_KEY_FILE") or None))


def push_pending(store: Any, name: str, url: str, result: Any, todo: list[Any]) -> None:
    """Push each of ``todo`` (VersionRows, oldest first) into the repository, recording each copy; stops at the
    first failure (the rest wait for the next run)."""
    try:
        repo = open_for_jobs(url)
    except Error as exc:
        result.error, result.waiting = f"the repository {url} cannot be opened: {exc}", [v.number for v in todo]
        return
    for i, v in enumerate(todo):
        try:
            report = push(store, v.ref, repo)
        except (Error, OSError) as exc:
            result.error = f"copy of {v.ref} to {url} failed: {exc}; retried at the next run"
            result.waiting = [w.number for w in todo[i:]]
            return
        store.catalogue.query("INSERT OR REPLACE INTO backup_copies(capsule, number, target, copied, wire_bytes) "
                              "VALUES(?,?,?,?,?)", (name, v.number, url, time.time(), report.uploaded_bytes))
        result.copied.append(v.number)
        result.wire_bytes += report.uploaded_bytes


def prune_there(store: Any, name: str, url: str, policy: Any) -> list[int]:
    """Apply ``policy`` to ``name``'s versions in the repository: forget those it does not keep, then prune
    (refused while another host pushes: the blocks are freed at a later run; the forgetting stands)."""
    from capsule.backup import retention

    repo = open_for_jobs(url)
    there = {}
    for _record, body in repo.versions():
        rec = body["record"]
        if rec["capsule"] == name:
            there[rec["number"]] = float(rec.get("created") or body.get("pushed") or 0)
    decisions = retention.apply([retention.Snapshot(n, t) for n, t in there.items()], policy)
    removed = [d.snapshot.number for d in decisions if not d.keep]
    for n in removed:
        maintain.forget(repo, f"{name}@{n}")
        store.catalogue.query("UPDATE backup_copies SET pruned=? WHERE capsule=? AND number=? AND target=?",
                              (time.time(), name, n, url))
    if removed:
        with suppress(Conflict):    # another host is writing: a later run's prune frees the blocks
            maintain.prune(repo)
    return removed


def verify_copies(url: str, refs: list[str]) -> dict[str, Any]:
    """``repo check --read-data`` of the repository: its bad packs, each with the backups that use it."""
    report = maintain.check(open_for_jobs(url), read_data=True)
    wanted = set(refs)
    broken = [{"kind": "pack", "id": pack, "error": next((e for e in report.errors if pack in e), "damaged"),
               "backups": [v for v in versions if v in wanted] or versions}
              for pack, versions in report.bad_packs.items()]
    other = [e for e in report.errors if not any(p in e for p in report.bad_packs)]
    return {"blocks": report.blocks, "packs": report.packs, "broken": broken, "errors": other}
