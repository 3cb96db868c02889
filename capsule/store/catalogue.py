"""The host's SQLite catalogue: images, layers, file objects (memory images,
kernels, initrds), capsules, versions and running instances, and the objects
received for a version that is not recorded yet (*pending*: gc keeps them for a
while, see ``hierarchy.gc``).

Every change that must be atomic goes through ``Catalogue.transaction()``."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsule.store import schema


@dataclass
class LayerRow:
    id: str
    parent: str | None
    virtual_size: int
    file_size: int
    stored_bytes: int
    blocks: int
    created: float


@dataclass
class FileRow:
    id: str
    role: str
    size: int
    allocated: int
    stored_bytes: int
    created: float


@dataclass
class ImageRow:
    name: str
    kind: str
    root_layer: str
    kernel: str
    initrd: str
    cmdline: str
    marker: str
    info: dict[str, Any]
    created: float


@dataclass
class CapsuleRow:
    name: str
    uuid: str
    image: str | None
    parent_capsule: str | None
    parent_version: int | None
    created: float


@dataclass
class VersionRow:
    capsule: str
    number: int
    parent_capsule: str | None
    parent_version: int | None
    memory: str | None
    chains: list[list[str]]
    config: dict[str, Any]
    note: str
    created: float

    @property
    def active(self) -> bool:
        return self.memory is not None

    @property
    def ref(self) -> str:
        return f"{self.capsule}@{self.number}"

    def layer_ids(self) -> set[str]:
        return {lid for chain in self.chains for lid in chain}

    def file_ids(self) -> set[str]:
        ids = {self.config["kernel"], self.config["initrd"]}
        if self.memory:
            ids.add(self.memory)
        return ids


@dataclass
class PendingRow:
    kind: str       # "layer" | "file"
    id: str
    added: float


@dataclass
class InstanceRow:
    capsule: str
    version: int
    domain: str
    leaves: list[str]
    chains: list[list[str]]
    accel: str
    dir: str
    started: float = field(default_factory=time.time)


class Catalogue:
    """Thin typed access to the SQLite catalogue of one store."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # one connection shared by the agent's worker threads, serialised by a lock
        self.db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self._rlock = threading.RLock()
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        schema.upgrade(self.db, path)   # every table, at this release's schema (capsule/store/schema.py)
        self._depth = 0

    def close(self) -> None:
        with self._rlock:
            self.db.close()

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> _Rows:
        with self._rlock:
            return _Rows(self.db.execute(sql, args).fetchall())

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic change; nested uses join the outer transaction."""
        self._rlock.acquire()
        try:
            yield from self._transaction()
        finally:
            self._rlock.release()

    def _transaction(self) -> Iterator[None]:
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self.db.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        else:
            self.db.execute("COMMIT")
        finally:
            self._depth = 0

    # -- meta -------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self._exec("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row["value"] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self._exec("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, value))

    # -- layers -----------------------------------------------------------
    def add_layer(self, row: LayerRow) -> None:
        self._exec(
            "INSERT OR IGNORE INTO layers VALUES(?,?,?,?,?,?,?)",
            (row.id, row.parent, row.virtual_size, row.file_size, row.stored_bytes, row.blocks, row.created),
        )

    def layer(self, layer_id: str) -> LayerRow | None:
        row = self._exec("SELECT * FROM layers WHERE id=?", (layer_id,)).fetchone()
        return LayerRow(**dict(row)) if row else None

    def layers(self) -> list[LayerRow]:
        return [LayerRow(**dict(r)) for r in self._exec("SELECT * FROM layers ORDER BY created")]

    def delete_layer(self, layer_id: str) -> None:
        self._exec("DELETE FROM layers WHERE id=?", (layer_id,))

    # -- files (memory images, kernels, initrds) --------------------------
    def add_file(self, row: FileRow) -> None:
        self._exec(
            "INSERT OR IGNORE INTO files VALUES(?,?,?,?,?,?)",
            (row.id, row.role, row.size, row.allocated, row.stored_bytes, row.created),
        )

    def file(self, file_id: str) -> FileRow | None:
        row = self._exec("SELECT * FROM files WHERE id=?", (file_id,)).fetchone()
        return FileRow(**dict(row)) if row else None

    def files(self) -> list[FileRow]:
        return [FileRow(**dict(r)) for r in self._exec("SELECT * FROM files ORDER BY created")]

    def delete_file(self, file_id: str) -> None:
        self._exec("DELETE FROM files WHERE id=?", (file_id,))

    # -- images -----------------------------------------------------------
    def add_image(self, row: ImageRow) -> None:
        self._exec(
            "INSERT OR REPLACE INTO images VALUES(?,?,?,?,?,?,?,?,?)",
            (row.name, row.kind, row.root_layer, row.kernel, row.initrd, row.cmdline, row.marker,
             json.dumps(row.info), row.created),
        )

    def image(self, name: str) -> ImageRow | None:
        row = self._exec("SELECT * FROM images WHERE name=?", (name,)).fetchone()
        return _image(row) if row else None

    def images(self) -> list[ImageRow]:
        return [_image(r) for r in self._exec("SELECT * FROM images ORDER BY name")]

    # -- capsules and versions ---------------------------------------------
    def add_capsule(self, row: CapsuleRow) -> None:
        self._exec(
            "INSERT INTO capsules VALUES(?,?,?,?,?,?)",
            (row.name, row.uuid, row.image, row.parent_capsule, row.parent_version, row.created),
        )

    def capsule(self, name: str) -> CapsuleRow | None:
        row = self._exec("SELECT * FROM capsules WHERE name=?", (name,)).fetchone()
        return CapsuleRow(**dict(row)) if row else None

    def capsules(self) -> list[CapsuleRow]:
        return [CapsuleRow(**dict(r)) for r in self._exec("SELECT * FROM capsules ORDER BY name")]

    def delete_capsule(self, name: str) -> None:
        self._exec("DELETE FROM capsules WHERE name=?", (name,))

    def add_version(self, row: VersionRow) -> None:
        self._exec(
            "INSERT INTO versions VALUES(?,?,?,?,?,?,?,?,?)",
            (row.capsule, row.number, row.parent_capsule, row.parent_version, row.memory,
             json.dumps(row.chains), json.dumps(row.config, sort_keys=True), row.note, row.created),
        )

    def set_version_chains(self, capsule: str, number: int, chains: list[list[str]]) -> None:
        self._exec(
            "UPDATE versions SET chains=? WHERE capsule=? AND number=?", (json.dumps(chains), capsule, number)
        )

    def version(self, capsule: str, number: int) -> VersionRow | None:
        row = self._exec(
            "SELECT * FROM versions WHERE capsule=? AND number=?", (capsule, number)
        ).fetchone()
        return _version(row) if row else None

    def latest_version(self, capsule: str) -> VersionRow | None:
        row = self._exec(
            "SELECT * FROM versions WHERE capsule=? ORDER BY number DESC LIMIT 1", (capsule,)
        ).fetchone()
        return _version(row) if row else None

    def next_version_number(self, capsule: str) -> int:
        row = self._exec("SELECT MAX(number) AS n FROM versions WHERE capsule=?", (capsule,)).fetchone()
        return (row["n"] or 0) + 1 if row else 1

    def versions(self, capsule: str | None = None) -> list[VersionRow]:
        if capsule is None:
            rows = self._exec("SELECT * FROM versions ORDER BY capsule, number")
        else:
            rows = self._exec("SELECT * FROM versions WHERE capsule=? ORDER BY number", (capsule,))
        return [_version(r) for r in rows]

    def delete_version(self, capsule: str, number: int) -> None:
        self._exec("DELETE FROM versions WHERE capsule=? AND number=?", (capsule, number))

    # -- pending objects (received, not yet in a recorded version) ------------
    def add_pending(self, kind: str, oid: str, added: float | None = None) -> None:
        self._exec("INSERT OR REPLACE INTO pending VALUES(?,?,?)", (kind, oid, time.time() if added is None else added))

    def pending(self) -> list[PendingRow]:
        return [PendingRow(**dict(r)) for r in self._exec("SELECT * FROM pending ORDER BY added")]

    def drop_pending(self, kind: str, oid: str) -> None:
        self._exec("DELETE FROM pending WHERE kind=? AND id=?", (kind, oid))

    # -- instances ----------------------------------------------------------
    def add_instance(self, row: InstanceRow) -> None:
        self._exec(
            "INSERT INTO instances VALUES(?,?,?,?,?,?,?,?)",
            (row.capsule, row.version, row.domain, json.dumps(row.leaves), json.dumps(row.chains),
             row.accel, row.dir, row.started),
        )

    def instance(self, capsule: str) -> InstanceRow | None:
        row = self._exec("SELECT * FROM instances WHERE capsule=?", (capsule,)).fetchone()
        return _instance(row) if row else None

    def instances(self) -> list[InstanceRow]:
        return [_instance(r) for r in self._exec("SELECT * FROM instances ORDER BY capsule")]

    def delete_instance(self, capsule: str) -> None:
        self._exec("DELETE FROM instances WHERE capsule=?", (capsule,))

    # -- tables owned by other modules (their schema: capsule/store/schema.py) ----------
    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        """One statement for a module that owns its table; rows as ``sqlite3.Row``."""
        return self._exec(sql, args)


class _Rows(list):
    """Fetched rows, usable like the cursor they came from."""

    def fetchone(self) -> sqlite3.Row | None:
        return self[0] if self else None


def _image(row: sqlite3.Row) -> ImageRow:
    d = dict(row)
    d["info"] = json.loads(d["info"])
    return ImageRow(**d)


def _version(row: sqlite3.Row) -> VersionRow:
    d = dict(row)
    d["chains"] = json.loads(d["chains"])
    d["config"] = json.loads(d["config"])
    return VersionRow(**d)


def _instance(row: sqlite3.Row) -> InstanceRow:
    d = dict(row)
    d["leaves"] = json.loads(d["leaves"])
    d["chains"] = json.loads(d["chains"])
    return InstanceRow(**d)
