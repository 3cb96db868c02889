"""Version records as they travel between hosts."""

from __future__ import annotations

import time
from typing import Any

from capsule.bounds import CREATED, MEMORY_MIB, VCPUS, VERSION, check
from capsule.errors import Conflict, InvalidName, NotFound
from capsule.names import check_name, check_object_id, check_uuid
from capsule.store import Store
from capsule.store.catalogue import CapsuleRow, VersionRow

CONFIG_KEYS = {"memory_mib": int, "vcpus": int, "kernel": str, "initrd": str, "cmdline": str, "marker": str}
CONFIG_BOUNDS = {"memory_mib": MEMORY_MIB, "vcpus": VCPUS}   # a received capsule asks a host for these


def version_record(store: Store, v: VersionRow) -> dict[str, Any]:
    cap = store.catalogue.capsule(v.capsule)
    return {
        "capsule": v.capsule, "number": v.number, "uuid": cap.uuid if cap else None,
        "image": cap.image if cap else None,
        "parent_capsule": v.parent_capsule, "parent_version": v.parent_version,
        "memory": v.memory, "chains": v.chains, "config": v.config, "note": v.note, "created": v.created,
    }


def objects_of(record: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
    """(layer ids in chain order, [(file id, role)]) referenced by a record."""
    layers: list[str] = []
    for chain in record["chains"]:
        for lid in chain:
            if lid not in layers:
                layers.append(lid)
    files = [(record["config"]["kernel"], "kernel"), (record["config"]["initrd"], "initrd")]
    if record.get("memory"):
        files.append((record["memory"], "memory"))
    return layers, files


def validate(record: Any) -> dict[str, Any]:
    """Check a record from a peer: names, ids, types, and every number within its bounds (a received capsule
    asks this host for its vCPUs and memory). Raises InvalidName."""
    if not isinstance(record, dict):
        raise InvalidName("a version record must be a JSON object")
    try:
        check_name(record["capsule"])
        check(VERSION, record["number"], "version number")
        chains = record["chains"]
        if (not isinstance(chains, list) or not chains or len(chains) > 16
                or not all(isinstance(c, list) and 0 < len(c) <= 4096 for c in chains)):
            raise InvalidName("bad disk chains")
        for chain in chains:
            for lid in chain:
                check_object_id(lid, "layer")
        if record.get("memory") is not None:
            check_object_id(record["memory"], "memory image")
        config = record["config"]
        if not isinstance(config, dict):
            raise InvalidName("bad config")
        for key, typ in CONFIG_KEYS.items():
            if key in CONFIG_BOUNDS and key in config:
                check(CONFIG_BOUNDS[key], config[key], f"config.{key}")
            elif not isinstance(config.get(key), typ):
                raise InvalidName(f"config field {key!r} missing or of the wrong type")
        optional = {"image": (str, type(None)), "free_page_reporting": (bool,), "balloon": (dict, type(None)),
                    "pod_network": (bool,)}
        for key in config:
            if key not in CONFIG_KEYS and key not in optional:
                raise InvalidName(f"unknown config field {key!r}")
            if key in optional and not isinstance(config[key], optional[key]):
                raise InvalidName(f"config field {key!r} has the wrong type")
        check_object_id(config["kernel"], "kernel")
        check_object_id(config["initrd"], "initrd")
        if record.get("uuid") is not None:
            check_uuid(record["uuid"], "capsule uuid")
        if record.get("image") is not None:
            check_name(record["image"], "image")
        if config.get("image") is not None:
            check_name(config["image"], "image")
        if record.get("parent_capsule") is not None:
            check_name(record["parent_capsule"])
        if record.get("parent_version") is not None:
            check(VERSION, record["parent_version"], "parent version")
        if record.get("created") is not None:
            check(CREATED, record["created"], "created")
        if not isinstance(record.get("note"), str | None):
            raise InvalidName("the note of a version record must be text")
    except (KeyError, TypeError) as exc:
        raise InvalidName(f"malformed version record ({exc})") from exc
    return record


def record_version(store: Store, record: dict[str, Any]) -> tuple[VersionRow, bool]:
    """Record a received version (all its objects must be here already) and
    release its objects from the pending set. Returns (row, created); an
    identical existing version is not an error. The objects are checked under
    the store lock, so gc cannot remove one between the check and the record."""
    from capsule.lifecycle.demand import is_remote
    from capsule.store.objectio import has_object

    validate(record)
    layers, files = objects_of(record)
    name, number = record["capsule"], record["number"]
    with store.lock(purpose=f"recording {name}@{number}"):
        for lid in layers:
            if not has_object(store, "layer", lid) and not is_remote(store, lid):
                raise NotFound(f"layer {lid[:12]} of {name}@{number} has not arrived")
        for fid, role in files:
            if not has_object(store, "file", fid):
                raise NotFound(f"{role} {fid[:12]} of {name}@{number} has not arrived")
        cat = store.catalogue
        existing = cat.version(name, number)
        if existing is not None:
            if existing.chains == record["chains"] and existing.memory == record.get("memory"):
                _release_pending(store, layers, files)
                return existing, False
            raise Conflict(f"{name}@{number} already exists here with other content")
        row = VersionRow(capsule=name, number=number, parent_capsule=record.get("parent_capsule"),
                         parent_version=record.get("parent_version"), memory=record.get("memory"),
                         chains=record["chains"], config=record["config"], note=record.get("note") or "received",
                         created=float(record.get("created") or time.time()))
        with cat.transaction():
            if cat.capsule(name) is None:
                import uuid as uuidlib

                cat.add_capsule(CapsuleRow(name, record.get("uuid") or str(uuidlib.uuid4()), record.get("image"),
                                           record.get("parent_capsule"), record.get("parent_version"), time.time()))
            cat.add_version(row)
            _release_pending(store, layers, files)
        return row, True


def _release_pending(store: Store, layers: list[str], files: list[tuple[str, str]]) -> None:
    """A recorded version now holds these objects: gc keeps them without the pending set."""
    with store.catalogue.transaction():
        for lid in layers:
            store.catalogue.drop_pending("layer", lid)
        for fid, _role in files:
            store.catalogue.drop_pending("file", fid)
