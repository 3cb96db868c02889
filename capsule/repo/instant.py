"""Instant restore: start a repository's capsule version here at once (``capsule start NAME@V --from s3://…``),
on a host that may never have held it. As a demand-paged start from a peer (:func:`capsule.transfer.run`):
the kernel, initrd and memory image come first, whole (restored as ``repo restore`` restores them); the disk
layers this store lacks only as their manifests and their blocks' places, and the disk server pages their
blocks in from the repository's packs as the guest reads them (:mod:`capsule.repo.pagein`). ``--prefetch``
pulls the rest in the background; ``capsule localize`` then makes them ordinary layers and the version no
longer needs the repository."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from capsule.errors import Unreachable
from capsule.lifecycle import demand
from capsule.repo import pagein
from capsule.repo.format import Entry
from capsule.repo.repository import Repository
from capsule.repo.restore import RestoreReport, read_manifest, restore_object, version_body
from capsule.store import Store
from capsule.store.objectio import has_object
from capsule.transfer.records import record_version

Say = Callable[[str], None]


@dataclass
class InstantReport:
    version: str
    url: str
    restored: list[str] = field(default_factory=list)        # files brought whole (kernel, initrd, memory)
    remote_layers: list[str] = field(default_factory=list)   # layers paged in on demand from the repository
    present: list[str] = field(default_factory=list)         # objects this store held (or paged in) already
    downloaded_bytes: int = 0                                 # what came before the start (files, manifests)
    seconds: float = 0.0                                      # until the version was recorded here
    recorded: bool = False
    start: Any = None                                         # lifecycle.StartResult

    def as_dict(self) -> dict[str, Any]:
        from capsule.views import start_dict

        out = {k: v for k, v in self.__dict__.items() if k != "start"}
        out["start"] = start_dict(self.start) if self.start is not None else None
        return out


def prepare(store: Store, ref: str, repo: Repository, say: Say = lambda _m: None) -> InstantReport:
    """Restore the version's files, make the layers this store lacks remote ones paged from ``repo``, record the
    version (NotFound if the repository holds no ``ref``)."""
    t0 = time.monotonic()
    report = InstantReport(ref, repo.location.url)
    received = repo.client.received_bytes
    with repo.lock(reading=True) as lock:
        record, objects = version_body(repo, ref)
        report.version = f"{record['capsule']}@{record['number']}"
        index: dict[bytes, Entry] | None = None
        files = RestoreReport(report.version, report.url)
        secret = pagein.secret_text(repo)
        for kind, oid, role, name in objects:
            if has_object(store, kind, oid) or (kind == "layer" and demand.is_remote(store, oid)):
                if kind == "layer" and demand.is_remote(store, oid) \
                        and demand.remote_info(store, oid)["url"] == report.url:
                    demand.token_file_for(store, report.url, secret)   # an earlier run's may have been removed
                report.present.append(oid)
                continue
            if index is None:
                say("reading the repository's indexes")
                index, _names = repo.load_index()
            with suppress(Unreachable):
                lock.refresh(if_due=True)
            if kind == "layer":
                say(f"manifest of layer {oid[:12]}")
                manifest = read_manifest(repo, kind, oid, name)
                pagein.write_places(demand.places_path(store, oid), manifest, repo.key, index)
                demand.add_remote_layer(store, manifest, report.url, secret, opener=pagein.OPENER)
                report.remote_layers.append(oid)
            else:
                say(f"{role} {oid[:12]}")
                restore_object(store, repo, index, kind, oid, role, name, files)
                report.restored.append(oid)
        _row, report.recorded = record_version(store, record)
    report.downloaded_bytes = repo.client.received_bytes - received
    report.seconds = round(time.monotonic() - t0, 3)
    return report


def start(store: Store, ref: str, repo: Repository, *, prefetch: bool = False, wait: bool = True,
          timeout: float = 180.0, say: Say = lambda _m: None) -> InstantReport:
    """Start ``NAME[@V]`` of ``repo`` here, its disks demand-paged from the repository (see the module). If the
    start fails the version stays recorded, its layers remote, and the repository's key is removed again unless
    another running instance reads from it."""
    from capsule import lifecycle

    report = prepare(store, ref, repo, say)
    try:
        report.start = lifecycle.start(store, report.version, prefetch=prefetch, wait=wait, timeout=timeout,
                                       say=say)
    except BaseException:
        demand.release_sources(store, {report.url: None})   # no run reads from it: its key leaves this host
        raise
    return report
