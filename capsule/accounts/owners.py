"""Who owns which capsule: the catalogue's ``owners`` table (capsule name and uuid, user). A row counts only
while the capsule of that name is the same capsule (its uuid): a capsule removed and made again under the
same name starts with no owner."""

from __future__ import annotations

import time

from capsule.accounts import users
from capsule.errors import NotFound
from capsule.names import check_name
from capsule.store import Store


def set_owner(store: Store, capsule: str, user: str) -> None:
    """Make ``user`` the owner of ``capsule`` (the one owner; replaces any other)."""
    check_name(capsule)
    users.get(store, user)
    row = store.catalogue.capsule(capsule)
    if row is None:
        raise NotFound(f"no capsule named {capsule!r} on this host")
    store.catalogue.query("INSERT OR REPLACE INTO owners VALUES(?,?,?,?)",
                                 (capsule, row.uuid, user, time.time()))


def owner_of(store: Store, capsule: str) -> str | None:
    rows = store.catalogue.query(
        "SELECT o.user FROM owners o JOIN capsules c ON c.name = o.capsule AND c.uuid = o.uuid "
        "WHERE o.capsule=?", (capsule,))
    return rows[0]["user"] if rows else None


def owned_by(store: Store, user: str) -> set[str]:
    rows = store.catalogue.query(
        "SELECT o.capsule FROM owners o JOIN capsules c ON c.name = o.capsule AND c.uuid = o.uuid "
        "WHERE o.user=?", (user,))
    return {r["capsule"] for r in rows}


def owners(store: Store) -> dict[str, str]:
    rows = store.catalogue.query(
        "SELECT o.capsule, o.user FROM owners o JOIN capsules c ON c.name = o.capsule AND c.uuid = o.uuid")
    return {r["capsule"]: r["user"] for r in rows}
