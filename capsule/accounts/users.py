"""Users in the catalogue's ``users`` table: name, role, password hash (scrypt; never the password)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from capsule.accounts import passwords
from capsule.accounts.model import ROLE_SCOPES, Principal, check_role, check_user
from capsule.errors import AlreadyExists, Conflict, NotFound
from capsule.store import Store


@dataclass(frozen=True)
class User:
    name: str
    role: str
    created: float
    has_password: bool

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "role": self.role, "created": self.created, "password": self.has_password}


def _user(row) -> User:  # noqa: ANN001 - sqlite3.Row
    return User(row["name"], row["role"], row["created"], row["password"] is not None)


def add(store: Store, name: str, role: str, password: str | None = None) -> User:
    """A new user; without a password it signs in with tokens only."""
    check_user(name)
    check_role(role)
    digest = passwords.hash_password(password) if password is not None else None
    cat = store.catalogue
    with cat.transaction():
        if cat.query("SELECT 1 FROM users WHERE name=?", (name,)):
            raise AlreadyExists(f"user {name!r} exists already (`capsule user ls`)")
        cat.query("INSERT INTO users VALUES(?,?,?,?)", (name, role, digest, time.time()))
    return get(store, name)


def get(store: Store, name: str) -> User:
    check_user(name)
    rows = store.catalogue.query("SELECT * FROM users WHERE name=?", (name,))
    if not rows:
        raise NotFound(f"no user named {name!r} (`capsule user ls` lists them)")
    return _user(rows[0])


def users(store: Store) -> list[User]:
    return [_user(r) for r in store.catalogue.query("SELECT * FROM users ORDER BY name")]


def admin_exists(store: Store) -> bool:
    return bool(store.catalogue.query("SELECT 1 FROM users WHERE role='admin' LIMIT 1"))


def remove(store: Store, name: str) -> User:
    """Remove a user, its tokens, the grants it made and its ownerships (the capsules stay; operators still act
    on them). The last admin is kept: without one, the old host token would work again."""
    from capsule.accounts import tokens

    user = get(store, name)
    cat = store.catalogue
    with cat.transaction():
        if user.role == "admin" and len(cat.query("SELECT 1 FROM users WHERE role='admin'")) == 1:
            raise Conflict(f"{name!r} is the last admin: add another admin first (`capsule user add NAME "
                           "--role admin`)")
        cat.query("DELETE FROM users WHERE name=?", (name,))
        cat.query("DELETE FROM tokens WHERE user=?", (name,))
        tokens.revoke_issued_by(cat, name)
        cat.query("DELETE FROM owners WHERE user=?", (name,))
    return user


def set_password(store: Store, name: str, password: str) -> User:
    """Set a user's password; the user's dashboard sessions end (the agent finds the stored hash changed)."""
    get(store, name)
    store.catalogue.query("UPDATE users SET password=? WHERE name=?", (passwords.hash_password(password), name))
    return get(store, name)


def sign_in(store: Store, name: str, password: str) -> Principal | None:
    """The principal for a right user name and password, else None (the same work either way)."""
    found = check_password(store, name, password)
    return found[0] if found is not None else None


def check_password(store: Store, name: str, password: str) -> tuple[Principal, str] | None:
    """:func:`sign_in`, with the password's :func:`password_stamp` as it was checked (what a session keeps)."""
    try:
        check_user(name)
        rows = store.catalogue.query("SELECT * FROM users WHERE name=?", (name,))
    except Exception:  # noqa: BLE001 - a malformed name is just a failed sign-in
        rows = []
    stored = rows[0]["password"] if rows and rows[0]["password"] else passwords.dummy_hash()
    ok = passwords.verify_password(password, stored) if isinstance(password, str) else False
    if not rows or not rows[0]["password"] or not ok:
        return None
    role = rows[0]["role"]
    return Principal(name, role, ROLE_SCOPES[role]), _stamp(stored)


def password_stamp(store: Store, name: str) -> str | None:
    """A digest of the user's stored password hash (salted afresh by every change, so any change — ``capsule user
    passwd``, or the user removed and added again — gives another); ``""`` without a password, None without the
    user. Sessions made with a password end when this changes."""
    rows = store.catalogue.query("SELECT password FROM users WHERE name=?", (name,))
    if not rows:
        return None
    return _stamp(rows[0]["password"]) if rows[0]["password"] else ""


def _stamp(stored: str) -> str:
    return hashlib.sha256(b"capsule password stamp\0" + stored.encode()).hexdigest()[:32]
