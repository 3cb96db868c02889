"""``capsule verify``: re-check every sealed layer and file object against
its manifest, every layer with ``qemu-img check``, and the modes of the
store's directories and files (capsule/store/modes.py); ``fix_modes`` repairs those.
``verify_versions`` checks only what some versions reference (backup verify
jobs, here and on a backup host through its agent); ``users_of`` says which
of them use each object."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from capsule import capsules, qemuimg
from capsule.errors import CapsuleError, NotFound
from capsule.store import Store
from capsule.store.catalogue import VersionRow
from capsule.store.modes import check_modes, fix_modes
from hashcache.errors import HashcacheError
from hashcache.manifest import verify_file, verify_layer


@dataclass
class Problem:
    kind: str        # "layer" | "memory" | "kernel" | "initrd" | "mode"
    id: str
    error: str


@dataclass
class VerifyReport:
    checked_layers: int = 0
    checked_files: int = 0
    problems: list[Problem] = field(default_factory=list)
    fixed_modes: list[str] = field(default_factory=list)     # paths whose mode was repaired

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checked_layers": self.checked_layers, "checked_files": self.checked_files,
                "problems": [asdict(p) for p in self.problems], "fixed_modes": self.fixed_modes}


@dataclass(frozen=True)
class Scope:
    """Only these objects (the layer and file ids some versions reference)."""

    layers: frozenset[str]
    files: frozenset[str]


def verify(store: Store, progress: Callable[[str], None] = lambda _m: None, *, repair_modes: bool = False,
           scope: Scope | None = None) -> VerifyReport:
    """Everything in the store, or with ``scope`` only those objects (file modes are checked only for
    the whole store)."""
    report = VerifyReport()
    if scope is None:
        progress("file modes")
        if repair_modes:
            report.fixed_modes = [str(p.path) for p in fix_modes(store)]
        for p in check_modes(store):
            report.problems.append(Problem("mode", str(p.path), p.describe()))
    cat = store.catalogue
    for row in cat.layers():
        if scope is not None and row.id not in scope.layers:
            continue
        progress(f"layer {row.id[:12]}")
        report.checked_layers += 1
        path = store.layer_path(row.id)
        try:
            if not path.exists():
                if cat.layer(row.id) is None:      # collected meanwhile (a prune's gc): nothing to check
                    report.checked_layers -= 1
                    continue
                raise CapsuleError("the layer file is missing")
            manifest = store.layer_manifest(row.id)
            if manifest.digest != row.id:
                raise CapsuleError(f"its manifest names {manifest.digest[:12]}, not this layer")
            if manifest.parent != row.parent:
                raise CapsuleError("its manifest names another parent than the catalogue")
            qemuimg.check(path)
            backing = qemuimg.info(path).get("backing-filename")
            expected = f"{row.parent}.qcow2" if row.parent else None
            if backing != expected:
                raise CapsuleError(f"its qcow2 header points at {backing!r}, expected {expected!r}")
            verify_layer(path, manifest, f"layer {row.id[:12]}")
        except (CapsuleError, HashcacheError, OSError) as exc:
            report.problems.append(Problem("layer", row.id, str(exc)))
    for frow in cat.files():
        if scope is not None and frow.id not in scope.files:
            continue
        progress(f"{frow.role} {frow.id[:12]}")
        report.checked_files += 1
        path = store.file_path(frow.id)
        try:
            if not path.exists():
                if cat.file(frow.id) is None:      # collected meanwhile
                    report.checked_files -= 1
                    continue
                raise CapsuleError("the file is missing")
            manifest = store.file_manifest(frow.id)
            if manifest.digest != frow.id:
                raise CapsuleError(f"its manifest names {manifest.digest[:12]}, not this object")
            verify_file(path, manifest, f"{frow.role} {frow.id[:12]}")
        except (CapsuleError, HashcacheError, OSError) as exc:
            report.problems.append(Problem(frow.role, frow.id, str(exc)))
    return report


def _versions(store: Store, refs: list[str]) -> tuple[list[VersionRow], list[str]]:
    """The versions ``refs`` (NAME@V each) that exist here, and the refs that do not."""
    found, missing = [], []
    for ref in refs:
        try:
            found.append(capsules.resolve(store, ref))
        except NotFound:
            missing.append(ref)
    return found, missing


def users_of(store: Store, refs: list[str]) -> dict[str, list[str]]:
    """object id -> the versions among ``refs`` (those this host has) that reference it."""
    out: dict[str, list[str]] = {}
    for v in _versions(store, refs)[0]:
        for oid in sorted(v.layer_ids() | v.file_ids()):
            out.setdefault(oid, []).append(v.ref)
    return out


def verify_versions(store: Store, refs: list[str], progress: Callable[[str], None] = lambda _m: None
                    ) -> VerifyReport:
    """Re-check only what the versions ``refs`` reference; a version this host does not have is a problem
    of its own (kind ``missing``), not a failure of the whole check."""
    versions, missing = _versions(store, refs)
    scope = Scope(frozenset(lid for v in versions for lid in v.layer_ids()),
                  frozenset(fid for v in versions for fid in v.file_ids()))
    report = verify(store, progress, scope=scope)
    report.problems[:0] = [Problem("missing", ref, "this host has no such version") for ref in missing]
    return report
