"""API tokens per user, in the catalogue's ``tokens`` table.

A token reads ``cap_ID_SECRET``: ``ID`` (12 hex digits) names its row, ``SECRET`` (256 random bits) is shown
once and stored only as its SHA-256 (a secret that random needs no slow hash). Each token has scopes (a subset of
what its user's role may hold), an optional expiry, and can be revoked. :func:`resolve` turns a bearer token into
the :class:`Principal` it acts as; the old single host token stands for an admin until an admin user exists."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from capsule.accounts import users
from capsule.accounts.model import ROLE_SCOPES, Principal, legacy_principal, parse_scopes
from capsule.bounds import GRANT_SECONDS, check
from capsule.catalogue import Catalogue
from capsule.errors import AuthFailed, InvalidName, NotFound
from capsule.store import Store

SCHEMA = """CREATE TABLE IF NOT EXISTS tokens(
    id TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    scopes TEXT NOT NULL,
    hash TEXT NOT NULL,
    created REAL NOT NULL,
    expires REAL,
    revoked REAL
)"""
_TOKEN_RE = re.compile(r"cap_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
_ID_RE = re.compile(r"[0-9a-f]{12}")
HOST_USER = "@host"     # the user of host grants: credentials this host hands a peer (scope host only)
LEGACY_GONE = ("the host's token stopped working when the first admin user was made: use a user's token "
               "(`capsule token create --user NAME --scope …`)")


@dataclass(frozen=True)
class Token:
    id: str
    user: str
    scopes: frozenset[str]
    created: float
    expires: float | None
    revoked: float | None

    def state(self, now: float | None = None) -> str:
        if self.revoked is not None:
            return "revoked"
        if self.expires is not None and (now or time.time()) >= self.expires:
            return "expired"
        return "active"

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "user": self.user, "scopes": sorted(self.scopes), "created": self.created,
                "expires": self.expires, "revoked": self.revoked, "state": self.state()}


def table(cat: Catalogue) -> Catalogue:
    cat.ensure_table(SCHEMA)
    return cat


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _token(row) -> Token:  # noqa: ANN001 - sqlite3.Row
    return Token(row["id"], row["user"], frozenset(row["scopes"].split(",")), row["created"], row["expires"],
                 row["revoked"])


def create(store: Store, user: str, scopes: list[str] | str, expires_in: float | None = None) -> tuple[Token, str]:
    """A new token for ``user``: its row and the token itself (shown once, never stored)."""
    u = users.get(store, user)
    granted = parse_scopes(scopes, u.role)
    if expires_in is not None and not 0 < expires_in <= 10 * 365 * 86400:
        raise InvalidName("a token's expiry must be in the future and within ten years")
    tid, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    now = time.time()
    table(store.catalogue).query("INSERT INTO tokens VALUES(?,?,?,?,?,?,NULL)",
                                 (tid, u.name, ",".join(sorted(granted)), _digest(secret), now,
                                  now + expires_in if expires_in else None))
    return get(store, tid), f"cap_{tid}_{secret}"


def host_grant(store: Store, expires_in: float | None = None) -> str:
    """A credential of this host for a peer's calls back to it (demand paging of a migration's disks, a
    fleet host pulling a version from here): scope ``host`` only, listed by ``capsule token ls`` under
    ``@host`` and revocable like any token; ``expires_in`` seconds, or no expiry."""
    tid, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    now = time.time()
    table(store.catalogue).query("INSERT INTO tokens VALUES(?,?,?,?,?,?,NULL)",
                                 (tid, HOST_USER, "host", _digest(secret), now,
                                  now + expires_in if expires_in else None))
    return f"cap_{tid}_{secret}"


def grant_request(store: Store, req: Any) -> dict[str, Any]:
    """``POST /v1/grants/host``: a host-only grant for a third host, asked for by a caller that may make
    host calls itself (a fleet rollout's origin, for the host that will pull from this one). It expires:
    ``{"expires_in": seconds}``, at most a day (default an hour)."""
    if not isinstance(req, dict):
        raise InvalidName('a grant request is {"expires_in": SECONDS}')
    seconds = check(GRANT_SECONDS, req.get("expires_in", 3600), "expires_in")
    token = host_grant(store, seconds)
    return {"token": token, "id": token.split("_")[1], "expires": time.time() + seconds}


def source_token(store: Store, legacy: str | None) -> str:
    """The token a peer uses to read from this host: the old host token while no admin exists, else a grant."""
    if legacy is not None and not users.admin_exists(store):
        return legacy
    return host_grant(store)


def get(store: Store, tid: str) -> Token:
    if not isinstance(tid, str) or not _ID_RE.fullmatch(tid):
        raise InvalidName(f"token id {str(tid)[:20]!r}: 12 hex digits, as `capsule token ls` shows")
    rows = table(store.catalogue).query("SELECT * FROM tokens WHERE id=?", (tid,))
    if not rows:
        raise NotFound(f"no token {tid} (`capsule token ls`)")
    return _token(rows[0])


def tokens(store: Store, user: str | None = None) -> list[Token]:
    cat = table(store.catalogue)
    if user is None:
        return [_token(r) for r in cat.query("SELECT * FROM tokens ORDER BY created")]
    if user != HOST_USER:
        users.get(store, user)
    return [_token(r) for r in cat.query("SELECT * FROM tokens WHERE user=? ORDER BY created", (user,))]


def revoke(store: Store, tid: str) -> Token:
    t = get(store, tid)
    if t.revoked is None:
        table(store.catalogue).query("UPDATE tokens SET revoked=? WHERE id=?", (time.time(), tid))
    return get(store, tid)


def resolve(store: Store, bearer: str, legacy: str | None) -> Principal:
    """The principal a bearer token acts as; :class:`AuthFailed` for anything else."""
    if legacy is not None and hmac.compare_digest(bearer.encode(), legacy.encode()):
        if users.admin_exists(store):
            raise AuthFailed(LEGACY_GONE)
        return legacy_principal()
    m = _TOKEN_RE.fullmatch(bearer)
    if m is None:
        raise AuthFailed("missing or wrong bearer token")
    rows = table(store.catalogue).query(
        "SELECT t.*, u.role AS role FROM tokens t LEFT JOIN users u ON u.name = t.user WHERE t.id=?", (m[1],))
    if not rows or not hmac.compare_digest(_digest(m[2]), rows[0]["hash"]):
        raise AuthFailed("missing or wrong bearer token")
    t = _token(rows[0])
    if t.state() != "active":
        raise AuthFailed(f"token {t.id} is {t.state()}: ask an admin for a new one")
    role = "operator" if t.user == HOST_USER else rows[0]["role"]
    if role is None:
        raise AuthFailed("missing or wrong bearer token")
    return Principal(t.user, role, t.scopes & ROLE_SCOPES[role], t.id)
