"""The capsule hierarchy (§4.2): promote, rm and gc (the tree of layers as data: ``views.tree_dict``).

Layers are named by a digest that covers their parent, so folding a parent
into a child makes a new child layer, and every layer below it is re-pointed
(a header-only rebase) under a new name. Versions are switched to the new
chains in one transaction; old files stay until nothing, not even a running
instance, uses them, and ``gc`` removes them."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from capsule import qemuimg
from capsule.capsules import resolve
from capsule.errors import Conflict, NotFound, RuntimeFailure
from capsule.names import parse_ref
from capsule.pod import POD_GROUP_ROLE, POD_IMAGE_ROLE
from capsule.store import Store, claims
from capsule.store.catalogue import LayerRow, VersionRow
from capsule.store.fsutil import disk_usage, remove_readonly
from capsule.store.modes import LEAF_MODE

Say = Callable[[str], None]
DEFAULT_PENDING_MAX_AGE = 24 * 3600.0


def copy_layer(store: Store, layer_id: str) -> Path:
    """A writable copy of a layer's file, as a new leaf path (shares its extents where the file system can)."""
    tmp = store.new_leaf_path()
    proc = subprocess.run(["cp", "--reflink=auto", "--sparse=always", str(store.layer_path(layer_id)), str(tmp)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeFailure(f"copying layer {layer_id[:12]}: {proc.stderr.strip()}")
    tmp.chmod(LEAF_MODE)
    return tmp


def rebased_copy(store: Store, layer_id: str, onto: str | None) -> LayerRow:
    """A new layer: ``layer_id`` rebased safely onto ``onto`` (or onto nothing), every block that differs
    copied into it, so it reads as ``layer_id`` does. Sealed, not yet recorded."""
    tmp = copy_layer(store, layer_id)
    try:
        qemuimg.rebase_safe(tmp, store.layer_path(onto) if onto else None)
        return store.seal_layer(tmp, onto)
    finally:
        tmp.unlink(missing_ok=True)


def _protected_layers(store: Store, without: Collection[tuple[str, int]] = ()) -> set[str]:
    """Layers that must not be folded away: chain tops, image roots, and every
    layer a running instance's leaves stand on (ignoring versions ``without``)."""
    cat = store.catalogue
    keep = {img.root_layer for img in cat.images()}
    for v in cat.versions():
        if (v.capsule, v.number) not in without:
            keep.update(chain[-1] for chain in v.chains)
    for inst in cat.instances():
        keep.update(lid for chain in inst.chains for lid in chain)
    return keep


def _foldable(store: Store, owned: set[str], without: set[tuple[str, int]]) -> dict[str, list[VersionRow]]:
    """Layers of ``owned`` that remaining versions build on without any of
    them ending there: deleting their owner means folding them into those
    dependants. Maps layer id → dependant versions."""
    protected = _protected_layers(store, without)
    out: dict[str, list[VersionRow]] = {}
    for v in store.catalogue.versions():
        if (v.capsule, v.number) in without:
            continue
        for chain in v.chains:
            for lid in chain[:-1]:
                if lid in owned and lid not in protected:
                    out.setdefault(lid, []).append(v)
    return out


def _fold(store: Store, parent_id: str, children: set[str], say: Say) -> dict[str, str]:
    """Fold layer ``parent_id`` into each of ``children``; re-point every layer
    in use below them. Returns old id → new id. Catalogue rows are added; the
    caller switches the version chains."""
    cat = store.catalogue
    parent = cat.layer(parent_id)
    if parent is None:
        raise NotFound(f"layer {parent_id[:12]} is not in the catalogue")
    grand = parent.parent
    in_use = {lid for v in cat.versions() for chain in v.chains for lid in chain}
    mapping: dict[str, str] = {}
    new_rows: list[LayerRow] = []
    for child in sorted(children):
        say(f"folding {parent_id[:12]} into {child[:12]}")
        row = rebased_copy(store, child, grand)
        mapping[child] = row.id
        new_rows.append(row)
    # re-point descendants, parents before children
    frontier = list(mapping)
    while frontier:
        old_parent = frontier.pop(0)
        for layer in cat.layers():
            if layer.parent != old_parent or layer.id not in in_use or layer.id in mapping:
                continue
            say(f"re-pointing {layer.id[:12]}")
            tmp = copy_layer(store, layer.id)
            try:
                qemuimg.rebase_unsafe(tmp, store.layer_path(mapping[old_parent]))
                row = store.seal_layer(tmp, mapping[old_parent])
            finally:
                tmp.unlink(missing_ok=True)
            mapping[layer.id] = row.id
            new_rows.append(row)
            frontier.append(layer.id)
    with cat.transaction():
        for row in new_rows:
            cat.add_layer(row)
        for v in cat.versions():
            chains = [_rewrite_chain(chain, parent_id, mapping) for chain in v.chains]
            if chains != v.chains:
                cat.set_version_chains(v.capsule, v.number, chains)
    return mapping


def _rewrite_chain(chain: list[str], folded: str, mapping: dict[str, str]) -> list[str]:
    out: list[str] = []
    for i, lid in enumerate(chain):
        if lid == folded and i + 1 < len(chain) and chain[i + 1] in mapping:
            continue
        out.append(mapping.get(lid, lid))
    return out


@dataclass
class PromoteResult:
    version: VersionRow
    before: list[str]
    after: list[str]
    rewritten: int


def promote(store: Store, ref: str, *, disk: int = 0, to_root: bool = False, say: Say = lambda _m: None
            ) -> PromoteResult:
    """Fold the parent of a version's latest layer into it (one level, or all the
    way to a root layer with ``to_root``). What the guest reads is unchanged."""
    with store.lock():
        version = resolve(store, ref)
        if not 0 <= disk < len(version.chains):
            raise NotFound(f"{version.ref} has no disk {disk} (it has {len(version.chains)})")
        before = list(version.chains[disk])
        if len(before) < 2:
            raise Conflict(f"disk {disk} of {version.ref} is already a root layer; nothing to promote")
        rewritten = 0
        while True:
            chain = _reread(store, version).chains[disk]
            if len(chain) < 2:
                break
            rewritten += len(_fold(store, chain[-2], {chain[-1]}, say))
            if not to_root:
                break
        now = _reread(store, version)
        return PromoteResult(now, before, now.chains[disk], rewritten)


def _reread(store: Store, version: VersionRow) -> VersionRow:
    """The catalogue's row of a version resolved under the store lock still held (so it is still there)."""
    row = store.catalogue.version(version.capsule, version.number)
    assert row is not None
    return row


@dataclass
class GcResult:
    layers: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    leaves: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    pending: list[str] = field(default_factory=list)          # received, not yet recorded: kept
    pending_expired: list[str] = field(default_factory=list)  # received and never recorded: no longer kept


@dataclass
class RmResult:
    removed: list[str]
    promoted: int
    gc: GcResult


def rm(store: Store, ref: str, *, promote_dependants: bool = False, say: Say = lambda _m: None) -> RmResult:
    """Delete a capsule (``NAME``) or one version (``NAME@V``), then collect
    what nothing references any more. Refused while the capsule runs that
    version. Versions that build on layers only the deleted ones end in
    (dependants) are refused too, unless ``promote_dependants``: then those
    layers are first folded into the dependants (§4.2), which stay
    byte-identical."""
    r = parse_ref(ref)
    with claims.claim(store, r.name, "being removed"), store.lock(purpose=f"removing {ref}"):
        cat = store.catalogue
        target = resolve(store, ref)
        victims = cat.versions(r.name) if r.version is None else [target]
        inst = cat.instance(r.name)
        if inst is not None and (r.version is None or inst.version == r.version):
            what = f"capsule {r.name!r} is running" + ("" if r.version is None else f" {target.ref}")
            raise Conflict(f"{what}; stop or suspend it first")
        without = {(v.capsule, v.number) for v in victims}
        owned = {lid for v in victims for lid in v.layer_ids()}
        foldable = _foldable(store, owned, without)
        if foldable and not promote_dependants:
            deps = sorted({v.ref for vs in foldable.values() for v in vs})
            raise Conflict(f"{', '.join(sorted(x.ref for x in victims))}: {', '.join(deps)} build on its layers; "
                           "rerun with --promote to fold those layers into them first")
        with cat.transaction():
            for v in victims:
                cat.delete_version(v.capsule, v.number)
            if not cat.versions(r.name) and inst is None:
                cat.delete_capsule(r.name)
        promoted = 0
        while foldable:
            layer = next(iter(foldable))
            children = {chain[i + 1] for v in cat.versions() for chain in v.chains
                        for i, lid in enumerate(chain[:-1]) if lid == layer}
            promoted += len(_fold(store, layer, children, say))
            foldable = _foldable(store, owned, set())
        return RmResult([v.ref for v in victims], promoted, gc(store))


def referenced(store: Store, also_layers: Collection[str] = (), also_files: Collection[str] = ()
               ) -> tuple[set[str], set[str]]:
    """(layer ids, file ids) that something references — images, versions,
    instances, and ``also_*`` (pending objects) — with all ancestors."""
    cat = store.catalogue
    layers: set[str] = set(also_layers)
    files: set[str] = set(also_files)
    for img in cat.images():
        layers.add(img.root_layer)
        files.update((img.kernel, img.initrd))
    for v in cat.versions():
        layers.update(v.layer_ids())
        files.update(v.file_ids())
    for inst in cat.instances():
        layers.update(lid for chain in inst.chains for lid in chain)
    files.update(f.id for f in cat.files() if f.role in (POD_IMAGE_ROLE, POD_GROUP_ROLE))  # kept until removed
    frontier = list(layers)
    while frontier:
        row = cat.layer(frontier.pop())
        if row and row.parent and row.parent not in layers:
            layers.add(row.parent)
            frontier.append(row.parent)
    return layers, files


def pending_max_age() -> float:
    """How long gc keeps a received object no recorded version uses yet (CAPSULE_PENDING_MAX_AGE, seconds)."""
    try:
        return float(os.environ.get("CAPSULE_PENDING_MAX_AGE", DEFAULT_PENDING_MAX_AGE))
    except ValueError:
        return DEFAULT_PENDING_MAX_AGE


def drop_pending(store: Store, ids: Collection[str] | None = None) -> list[str]:
    """Stop protecting received objects (``ids``, or all) that no version was recorded for:
    the next gc removes them unless something else references them. Returns the ids dropped."""
    with store.lock(purpose="dropping pending objects"):
        cat = store.catalogue
        dropped = [p for p in cat.pending() if ids is None or p.id in ids]
        with cat.transaction():
            for p in dropped:
                cat.drop_pending(p.kind, p.id)
        return [p.id for p in dropped]


def _sort_pending(store: Store, max_age: float, dry_run: bool, used: tuple[set[str], set[str]]
                  ) -> tuple[set[str], set[str], list[str]]:
    """(pending layers to keep, pending files to keep, ids whose protection ran out). Entries that
    ran out, whose object is gone, or that something ``used`` holds now leave the pending set
    (unless ``dry_run``)."""
    cat = store.catalogue
    now = time.time()
    layers: set[str] = set()
    files: set[str] = set()
    expired: list[str] = []
    stale = []
    for p in cat.pending():
        present = (cat.layer(p.id) if p.kind == "layer" else cat.file(p.id)) is not None
        held = p.id in (used[0] if p.kind == "layer" else used[1])
        if not present or held or now - p.added >= max_age:
            stale.append(p)
            if present and not held:
                expired.append(p.id)
        else:
            (layers if p.kind == "layer" else files).add(p.id)
    if stale and not dry_run:
        with cat.transaction():
            for p in stale:
                cat.drop_pending(p.kind, p.id)
    return layers, files, expired


def gc(store: Store, *, dry_run: bool = False, max_pending_age: float | None = None) -> GcResult:
    """Remove layers and file objects nothing references, leaves of instances
    that no longer exist, and stale temporary files. Objects received for a
    version that is not recorded yet (pending) are kept for ``max_pending_age``
    seconds (default ``pending_max_age()``, 24 h), with their ancestors."""
    with store.lock(purpose="gc"):
        cat = store.catalogue
        age = pending_max_age() if max_pending_age is None else max_pending_age
        pending_layers, pending_files, expired = _sort_pending(store, age, dry_run, referenced(store))
        keep_layers, keep_files = referenced(store, pending_layers, pending_files)
        result = GcResult(pending=sorted(pending_layers | pending_files), pending_expired=expired)
        # (and those an operation under way made before an instance records them: a disk-only backup's)
        live_leaves = {leaf for inst in cat.instances() for leaf in inst.leaves} | claims.leaves_in_flight(store)
        doomed_layers = [row.id for row in cat.layers() if row.id not in keep_layers]
        doomed_files = [row.id for row in cat.files() if row.id not in keep_files]
        known_layers = {row.id for row in cat.layers()}
        known_files = {row.id for row in cat.files()}
        # objects on disk the catalogue never recorded (an interrupted operation)
        for p in store.layers_dir.glob("*.qcow2"):
            stem = p.stem
            if p.name.startswith("leaf-"):
                if str(p) not in live_leaves and time.time() - p.stat().st_mtime > 60:
                    result.leaves.append(p.name)
                    result.freed_bytes += disk_usage(p)
                    if not dry_run:
                        p.unlink(missing_ok=True)
            elif stem not in known_layers and stem not in doomed_layers:
                doomed_layers.append(stem)
        for p in store.files_dir.iterdir():
            if not p.name.endswith(".manifest") and p.name not in known_files and p.name not in doomed_files:
                doomed_files.append(p.name)
        for lid in doomed_layers:
            path = store.layers_dir / f"{lid}.qcow2"
            if path.exists():
                result.freed_bytes += disk_usage(path)
            result.layers.append(lid)
            if not dry_run:
                remove_readonly(path)
                remove_readonly(store.layers_dir / f"{lid}.manifest")
        for fid in doomed_files:
            path = store.files_dir / fid
            if path.exists():
                result.freed_bytes += disk_usage(path)
            result.files.append(fid)
            if not dry_run:
                remove_readonly(path)
                remove_readonly(store.files_dir / f"{fid}.manifest")
        if not dry_run:
            with cat.transaction():
                for lid in doomed_layers:
                    cat.delete_layer(lid)
                for fid in doomed_files:
                    cat.delete_file(fid)
            store.clean_tmp()
            for d in store.instances_dir.iterdir():
                if cat.instance(d.name) is None:
                    shutil.rmtree(d, ignore_errors=True)
        return result
