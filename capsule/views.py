"""Capsules and versions as plain data: what the CLI prints under ``--json`` and what the dashboard's API
returns. One place builds these dicts, so a script sees the same fields from either."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from capsule.capsules import CapsuleState, list_states
from capsule.hierarchy import RmResult
from capsule.lifecycle import SealResult, StartResult, demand
from capsule.store import Store
from capsule.store.catalogue import CapsuleRow, FileRow, ImageRow, InstanceRow, LayerRow, VersionRow


def _disk_size(store: Store, chain: list[str]) -> int | None:
    """The disk's size as the guest sees it (its top layer's virtual size), None if unknown here."""
    row = store.catalogue.layer(chain[-1]) if chain else None
    return row.virtual_size if row else None


def version_dict(store: Store, v: VersionRow, *, progress: bool = True) -> dict[str, Any]:
    """A version: its disks' layer chains (with sizes; remote layers with their source and, when
    ``progress``, how many of their blocks are here — that reads the layer's manifest), memory image,
    config and parent."""
    cat = store.catalogue
    mem = cat.file(v.memory) if v.memory else None
    layers = []
    for chain in v.chains:
        rows = [cat.layer(lid) for lid in chain]
        disk = []
        for lid, r in zip(chain, rows, strict=True):
            entry: dict[str, Any] = {"id": lid, "stored_bytes": r.stored_bytes if r else None,
                                     "file_bytes": r.file_size if r else None}
            if demand.is_remote(store, lid):
                entry["remote"] = {"url": demand.remote_info(store, lid)["url"]}
                if progress:
                    present, total = demand.layer_progress(store, lid)
                    entry["remote"] |= {"blocks_local": present, "blocks": total}
            disk.append(entry)
        layers.append(disk)
    return {
        "ref": v.ref, "capsule": v.capsule, "version": v.number, "active": v.active,
        "parent": f"{v.parent_capsule}@{v.parent_version}" if v.parent_capsule else None,
        "memory": {"id": v.memory, "size": mem.size, "allocated": mem.allocated,
                   "stored_bytes": mem.stored_bytes} if mem else None,
        "disks": layers, "disk_sizes": [_disk_size(store, chain) for chain in v.chains],
        "system": (v.config.get("system") or {}).get("ref"), "config": v.config, "note": v.note, "created": v.created,
    }


def depends_on(version: dict[str, Any]) -> list[str]:
    """The agents (URLs) a version built by :func:`version_dict` still reads blocks from."""
    return sorted({x["remote"]["url"] for disk in version["disks"] for x in disk if "remote" in x})


def seal_dict(r: SealResult) -> dict[str, Any]:
    """What suspend, snapshot and stop made: the new version, its memory image and layers."""
    return {
        "version": r.version.ref if r.version else None,
        "memory": {"id": r.memory.id, "size": r.memory.size, "allocated": r.memory.allocated,
                   "stored_bytes": r.memory.stored_bytes} if r.memory else None,
        "layers": [{"id": x.id, "stored_bytes": x.stored_bytes, "file_bytes": x.file_size} for x in r.layers],
        "balloon": r.balloon.as_dict() if r.balloon else None,
        "save_seconds": round(r.save_seconds, 3),
        "seal_seconds": round(r.seal_seconds, 3),
    }


def start_dict(r: StartResult) -> dict[str, Any]:
    """How a start went: version, domain, boot or restore, accelerator, seconds."""
    return {"version": r.version.ref, "domain": r.domain, "mode": r.mode, "accel": r.accel,
            "seconds": round(r.seconds, 3), "forked_memory": r.forked_memory}


def rm_dict(r: RmResult) -> dict[str, Any]:
    """What ``rm`` removed, promoted and collected."""
    return {"removed": r.removed, "promoted_layers": r.promoted, "gc": asdict(r.gc)}


def state_dict(store: Store, s: CapsuleState) -> dict[str, Any]:
    """One line of ``capsule ls``."""
    return {"name": s.name, "state": s.state, "latest": s.latest.number, "active": s.latest.active,
            "versions": len(store.catalogue.versions(s.name)),
            "domain": s.instance.domain if s.instance else None}


def overview(store: Store, host_of: Callable[[str], str | None] = lambda _url: None) -> list[dict[str, Any]]:
    """Every capsule of the store with all its versions: state, sizes, and the hosts each version still
    depends on (``host_of`` names a URL's peer, when it is one). What the dashboard shows."""
    out = []
    for s in list_states(store):
        versions = []
        for v in store.catalogue.versions(s.name):
            d = version_dict(store, v, progress=False)
            d["depends_on"] = [{"url": url, "host": host_of(url)} for url in depends_on(d)]
            d["disk_bytes"] = sum(x["stored_bytes"] or 0 for disk in d["disks"] for x in disk)
            versions.append(d)
        out.append(state_dict(store, s) | {"versions": versions, "version_count": len(versions)})
    return out


# -- the hierarchy (the paper's Fig. 1) as a graph -------------------------------------------------------

@dataclass
class TreeParts:
    """What the hierarchy is drawn from: the catalogue's rows, each capsule's state, and the remote layers
    (a layer another agent holds: id → {"parent", "url"}) that versions here build on."""

    store_id: str
    layers: list[LayerRow]
    images: list[ImageRow]
    capsules: list[CapsuleRow]
    versions: list[VersionRow]
    instances: list[InstanceRow]
    files: dict[str, FileRow]
    states: dict[str, str]
    remote: dict[str, dict[str, Any]] = field(default_factory=dict)


def tree_graph(p: TreeParts) -> dict[str, Any]:
    """The hierarchy as a graph: layers (parents before children, siblings oldest first, each with its
    parent and depth), images on their root layers, capsules with their state, versions with the top layer
    of each disk, their chains and memory image, memory images with the versions that use them, and the
    running instances. Pure: what ``capsule tree --json`` prints and ``GET /api/tree`` answers."""
    rows: dict[str, dict[str, Any]] = {
        r.id: {"id": r.id, "parent": r.parent, "stored_bytes": r.stored_bytes, "file_bytes": r.file_size,
               "created": r.created, "remote": None} for r in p.layers}
    for lid, info in p.remote.items():
        rows.setdefault(lid, {"id": lid, "parent": info.get("parent"), "stored_bytes": None, "file_bytes": None,
                              "created": info.get("added", 0.0), "remote": {"url": info["url"]}})
    for r in rows.values():
        if r["parent"] not in rows:
            r["parent"] = None          # its parent is not known here: drawn as a root
    children: dict[str | None, list[str]] = {}
    for lid, r in rows.items():
        children.setdefault(r["parent"], []).append(lid)
    image_names: dict[str, list[str]] = {}
    for img in p.images:
        image_names.setdefault(img.root_layer, []).append(img.name)
    tops: dict[str, list[str]] = {}
    for v in p.versions:
        for chain in v.chains:
            if chain:
                tops.setdefault(chain[-1], []).append(v.ref)
    running = {(i.capsule, i.version) for i in p.instances}
    layers: list[dict[str, Any]] = []
    frontier = [(lid, 0) for lid in sorted(children.get(None, []), key=lambda c: (rows[c]["created"], c))]
    while frontier:                     # depth first, parents before children
        lid, depth = frontier.pop(0)
        layers.append(rows[lid] | {"depth": depth, "images": sorted(image_names.get(lid, [])),
                                   "versions": tops.get(lid, [])})
        kids = sorted(children.get(lid, []), key=lambda c: (rows[c]["created"], c))
        frontier[:0] = [(c, depth + 1) for c in kids]
    memory: dict[str, dict[str, Any]] = {}
    versions = []
    for v in p.versions:
        mem = p.files.get(v.memory) if v.memory else None
        if mem is not None:
            memory.setdefault(mem.id, {"id": mem.id, "size": mem.size, "allocated": mem.allocated,
                                       "stored_bytes": mem.stored_bytes, "versions": []})["versions"].append(v.ref)
        versions.append({
            "ref": v.ref, "capsule": v.capsule, "version": v.number, "active": v.active,
            "parent": f"{v.parent_capsule}@{v.parent_version}" if v.parent_capsule else None,
            "tops": [chain[-1] if chain else None for chain in v.chains], "chains": v.chains,
            "memory": v.memory, "running": (v.capsule, v.number) in running, "created": v.created,
        })
    return {
        "store_id": p.store_id,
        "layers": layers,
        "images": [{"name": i.name, "kind": i.kind, "root_layer": i.root_layer} for i in p.images],
        "capsules": [{"name": c.name, "state": p.states.get(c.name, "empty"),
                      "parent": f"{c.parent_capsule}@{c.parent_version}" if c.parent_capsule else None,
                      "image": c.image} for c in p.capsules],
        "versions": versions,
        "memory_images": list(memory.values()),
        "instances": [{"capsule": i.capsule, "version": i.version, "ref": f"{i.capsule}@{i.version}",
                       "domain": i.domain, "state": p.states.get(i.capsule, "running"),
                       "tops": [chain[-1] if chain else None for chain in i.chains], "started": i.started}
                      for i in p.instances],
    }


def tree_dict(store: Store) -> dict[str, Any]:
    """This store's hierarchy as :func:`tree_graph` draws it, read from its catalogue."""
    cat = store.catalogue
    versions = cat.versions()
    known = {r.id for r in cat.layers()}
    remote: dict[str, dict[str, Any]] = {}
    frontier = [lid for v in versions for chain in v.chains for lid in chain if lid not in known]
    while frontier:                     # remote layers, and their remote parents
        lid = frontier.pop()
        if lid in remote or lid in known or not demand.is_remote(store, lid):
            continue
        remote[lid] = demand.remote_info(store, lid)
        if remote[lid].get("parent"):
            frontier.append(remote[lid]["parent"])
    return tree_graph(TreeParts(
        store_id=store.id, layers=cat.layers(), images=cat.images(), capsules=cat.capsules(), versions=versions,
        instances=cat.instances(), files={f.id: f for f in cat.files()},
        states={s.name: s.state for s in list_states(store)}, remote=remote))
