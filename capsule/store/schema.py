"""The catalogue's schema, in one place: every table, and the ordered migrations that bring a catalogue made by
any earlier release to this one.

A catalogue records the schema version it has in SQLite's ``PRAGMA user_version``: 0 for one made before
versions existed (0.1.0 and earlier, whose modules created their tables when first used and added columns as
they found them missing), then the number of the last migration applied. Opening a catalogue applies the
migrations it lacks, in order, in one transaction (``BEGIN IMMEDIATE``: two processes opening it at once
apply them once); one whose version is newer than :data:`SCHEMA_VERSION` was made by a newer release and is
refused, unchanged. A migration never rewrites what it does not own, and is written once: a change to the
schema is a new migration at the end, never an edit of one that shipped. ``docs/formats.md`` describes the
tables; ``tests/tools/test_store_upgrade.py`` opens a store of 0.1.0 (``tests/data/stores/``)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from capsule import __version__
from capsule.errors import EnvironmentProblem

# -- version 1: the tables of 0.1.0, each as its module made it, with the columns it added later ------------

_V1_TABLES = (
    "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS layers(
        id TEXT PRIMARY KEY, parent TEXT, virtual_size INTEGER NOT NULL, file_size INTEGER NOT NULL,
        stored_bytes INTEGER NOT NULL, blocks INTEGER NOT NULL, created REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS files(
        id TEXT PRIMARY KEY, role TEXT NOT NULL, size INTEGER NOT NULL, allocated INTEGER NOT NULL,
        stored_bytes INTEGER NOT NULL, created REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS images(
        name TEXT PRIMARY KEY, kind TEXT NOT NULL, root_layer TEXT NOT NULL, kernel TEXT NOT NULL,
        initrd TEXT NOT NULL, cmdline TEXT NOT NULL, marker TEXT NOT NULL, info TEXT NOT NULL,
        created REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS capsules(
        name TEXT PRIMARY KEY, uuid TEXT NOT NULL, image TEXT, parent_capsule TEXT, parent_version INTEGER,
        created REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS versions(
        capsule TEXT NOT NULL REFERENCES capsules(name), number INTEGER NOT NULL, parent_capsule TEXT,
        parent_version INTEGER, memory TEXT, chains TEXT NOT NULL, config TEXT NOT NULL,
        note TEXT NOT NULL DEFAULT '', created REAL NOT NULL, PRIMARY KEY(capsule, number))""",
    """CREATE TABLE IF NOT EXISTS pending(
        kind TEXT NOT NULL, id TEXT NOT NULL, added REAL NOT NULL, PRIMARY KEY(kind, id))""",
    """CREATE TABLE IF NOT EXISTS instances(
        capsule TEXT PRIMARY KEY REFERENCES capsules(name), version INTEGER NOT NULL, domain TEXT NOT NULL,
        leaves TEXT NOT NULL, chains TEXT NOT NULL, accel TEXT NOT NULL, dir TEXT NOT NULL,
        started REAL NOT NULL)""",
    # capsule/hosts.py
    """CREATE TABLE IF NOT EXISTS peers(
        name TEXT PRIMARY KEY, url TEXT NOT NULL UNIQUE, token TEXT NOT NULL, store_id TEXT NOT NULL,
        added REAL NOT NULL, fingerprint TEXT)""",
    # capsule/accounts/
    "CREATE TABLE IF NOT EXISTS users(name TEXT PRIMARY KEY, role TEXT NOT NULL, password TEXT, created REAL NOT NULL)",
    """CREATE TABLE IF NOT EXISTS tokens(
        id TEXT PRIMARY KEY, user TEXT NOT NULL, scopes TEXT NOT NULL, hash TEXT NOT NULL, created REAL NOT NULL,
        expires REAL, revoked REAL)""",
    """CREATE TABLE IF NOT EXISTS owners(
        capsule TEXT PRIMARY KEY, uuid TEXT NOT NULL, user TEXT NOT NULL, since REAL NOT NULL)""",
    # capsule/fleet/
    """CREATE TABLE IF NOT EXISTS fleet_members(
        host TEXT PRIMARY KEY, grp TEXT NOT NULL, added REAL NOT NULL, last_seen REAL)""",
    """CREATE TABLE IF NOT EXISTS fleet_capsules(
        name TEXT PRIMARY KEY, version INTEGER NOT NULL, pushed REAL NOT NULL)""",
    # capsule/backup/
    """CREATE TABLE IF NOT EXISTS backup_jobs(
        capsule TEXT PRIMARY KEY, calendar TEXT NOT NULL, policy TEXT NOT NULL, mode TEXT NOT NULL, target TEXT,
        created REAL NOT NULL, next_run REAL, running_since REAL, running_by TEXT, last_run REAL,
        last_result TEXT, last_duration REAL, last_bytes INTEGER, last_pause REAL, last_version INTEGER,
        last_error TEXT, target_policy TEXT)""",
    """CREATE TABLE IF NOT EXISTS backup_copies(
        capsule TEXT NOT NULL, number INTEGER NOT NULL, target TEXT NOT NULL, copied REAL NOT NULL,
        wire_bytes INTEGER NOT NULL, pruned REAL, PRIMARY KEY(capsule, number, target))""",
    """CREATE TABLE IF NOT EXISTS backup_verify(
        id INTEGER PRIMARY KEY CHECK (id = 1), calendar TEXT NOT NULL, next_run REAL, last_run REAL,
        last_result TEXT, last_error TEXT)""",
)
# columns 0.1.0's modules added to tables of catalogues made before them (their ensure_column calls)
_V1_LATE_COLUMNS = (("peers", "fingerprint", "TEXT"), ("backup_jobs", "target_policy", "TEXT"),
                    ("backup_copies", "pruned", "REAL"))


def _add_column(db: sqlite3.Connection, table: str, column: str, decl: str) -> None:
    if column not in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
        db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def _v1(db: sqlite3.Connection) -> None:
    """Every table of 0.1.0, complete: a 0.1.0 catalogue has only the tables its store used, some of them
    without the columns added later."""
    for ddl in _V1_TABLES:
        db.execute(ddl)
    for table, column, decl in _V1_LATE_COLUMNS:
        _add_column(db, table, column, decl)


def _v2(db: sqlite3.Connection) -> None:
    """Grants name their capability, their target and who made them (capsule/accounts/grants.py). The host
    grants 0.1.0 made have none of these, and are refused when used."""
    for column, decl in (("allow", "TEXT"), ("capsule", "TEXT"), ("version", "INTEGER"), ("issuer", "TEXT"),
                         ("issuer_token", "TEXT"), ("detail", "TEXT")):
        _add_column(db, "tokens", column, decl)


@dataclass(frozen=True)
class Migration:
    version: int
    what: str
    apply: Callable[[sqlite3.Connection], None]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "the tables of 0.1.0, complete", _v1),
    Migration(2, "grants name their capability, target and maker", _v2),
)
SCHEMA_VERSION = MIGRATIONS[-1].version


def version_of(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def _check(path: Path, version: int) -> None:
    if version > SCHEMA_VERSION:
        raise EnvironmentProblem(
            f"the catalogue {path} was made by a newer Capsule (schema {version}); capsule {__version__} reads "
            f"schemas up to {SCHEMA_VERSION}: upgrade Capsule on this host (the catalogue was left as it is)")


def upgrade(db: sqlite3.Connection, path: Path) -> int:
    """Bring the open catalogue ``db`` to :data:`SCHEMA_VERSION`; the version it had. Refuses a newer one."""
    before = version_of(db)
    _check(path, before)
    if before == SCHEMA_VERSION:
        return before
    db.execute("BEGIN IMMEDIATE")
    try:
        current = version_of(db)          # another process may have upgraded it meanwhile
        _check(path, current)
        for m in MIGRATIONS:
            if m.version > current:
                m.apply(db)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return before
