"""API tokens per user, in the catalogue's ``tokens`` table.

A token reads ``cap_ID_SECRET``: ``ID`` (12 hex digits) names its row, ``SECRET`` (256 random bits) is shown
once and stored only as its SHA-256 (a secret that random needs no slow hash). Each token has scopes (a subset of
what its user's role may hold), an optional expiry, and can be revoked. :func:`resolve` turns a bearer token into
the :class:`Principal` it acts as; the old single host token stands for an admin until an admin user exists.

Grants (rows of user ``@host``, made by :mod:`capsule.accounts.grants`) live in the same table: a capability
instead of scopes, always an expiry, and who made them. A grant authenticates only while the user and token that
made it stand: revoking that token or removing that user revokes its grants."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from capsule.accounts import users
from capsule.accounts.model import GRANT_ROLE, ROLE_SCOPES, Grant, Principal, legacy_principal, parse_scopes
from capsule.errors import AuthFailed, InvalidName, NotFound
from capsule.store import Store
from capsule.store.catalogue import Catalogue

# a grant's columns (added in place to a table made before grants named what they allow): its capability,
# capsule and version, who made it (a user, LEGACY_ISSUER or unix:NAME, and the token it used), and a JSON
# detail (a read grant's capsule uuid, a push grant's version record). A @host row without ``allow`` is an
# old unbounded host grant: refused.
COLUMNS = ("id", "user", "scopes", "hash", "created", "expires", "revoked",      # the table: capsule/store/schema.py
           "allow", "capsule", "version", "issuer", "issuer_token", "detail")
_TOKEN_RE = re.compile(r"cap_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
_ID_RE = re.compile(r"[0-9a-f]{12}")
HOST_USER = "@host"     # the user of grants: capabilities this host hands a peer (capsule/accounts/grants.py)
GRANT_SCOPE = "grant"   # what the scopes column holds for a grant (it has a capability, not scopes)
LEGACY_ISSUER = "@host-token"   # a grant made with the old host token: it ends with that token (the first admin)
LEGACY_GONE = ("the host's token stopped working when the first admin user was made: use a user's token "
               "(`capsule token create --user NAME --scope …`)")
_SELECT = ("SELECT t.*, u.role AS role, iu.name AS issuer_user, it.id AS issuer_found, it.revoked AS "
           "issuer_revoked, it.expires AS issuer_expires FROM tokens t LEFT JOIN users u ON u.name = t.user "
           "LEFT JOIN users iu ON iu.name = t.issuer LEFT JOIN tokens it ON it.id = t.issuer_token")


@dataclass(frozen=True)
class Token:
    id: str
    user: str
    scopes: frozenset[str]
    created: float
    expires: float | None
    revoked: float | None
    grant: Grant | None = None
    issuer_live: bool = True     # a grant: the user (and token) that made it still stands

    def state(self, now: float | None = None) -> str:
        if self.revoked is not None or not self.issuer_live:
            return "revoked"
        if self.user == HOST_USER and self.grant is None:
            return "expired"          # an old host grant: it named no capability and never expired
        if self.expires is not None and (now or time.time()) >= self.expires:
            return "expired"
        return "active"

    def as_dict(self) -> dict[str, object]:
        g = self.grant
        return {"id": self.id, "user": self.user, "scopes": sorted(self.scopes), "created": self.created,
                "expires": self.expires, "revoked": self.revoked, "state": self.state(),
                "allow": g.allow if g else None, "capsule": g.capsule if g else None,
                "version": g.version if g else None, "issuer": g.issuer if g else None,
                "issuer_token": g.issuer_token if g else None}


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _insert(cat: Catalogue, values: dict[str, Any]) -> None:
    cat.query(f"INSERT INTO tokens({','.join(COLUMNS)}) VALUES({','.join('?' * len(COLUMNS))})",
              tuple(values.get(c) for c in COLUMNS))


def _issuer_live(row, admin: bool) -> bool:  # noqa: ANN001 - sqlite3.Row
    issuer = row["issuer"]
    if row["allow"] is None or issuer is None or issuer.startswith("unix:"):
        return True
    if issuer == LEGACY_ISSUER:
        return not admin
    if row["issuer_user"] is None:
        return False                  # the user that made it was removed
    if row["issuer_token"] is None:
        return True                   # made by a signed-in user (a dashboard migration)
    return row["issuer_found"] is not None and row["issuer_revoked"] is None and (
        row["issuer_expires"] is None or time.time() < row["issuer_expires"])


def _grant(row) -> Grant | None:  # noqa: ANN001 - sqlite3.Row
    if row["allow"] is None:
        return None
    detail = json.loads(row["detail"] or "{}")
    return Grant(row["allow"], row["capsule"], row["version"], row["issuer"], row["issuer_token"],
                 detail.get("uuid"), detail.get("record"))


def _token(row, admin: bool = False) -> Token:  # noqa: ANN001 - sqlite3.Row
    return Token(row["id"], row["user"], frozenset(row["scopes"].split(",")), row["created"], row["expires"],
                 row["revoked"], _grant(row), _issuer_live(row, admin))


def create(store: Store, user: str, scopes: list[str] | str, expires_in: float | None = None) -> tuple[Token, str]:
    """A new token for ``user``: its row and the token itself (shown once, never stored)."""
    u = users.get(store, user)
    granted = parse_scopes(scopes, u.role)
    if expires_in is not None and not 0 < expires_in <= 10 * 365 * 86400:
        raise InvalidName("a token's expiry must be in the future and within ten years")
    tid, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    now = time.time()
    _insert(store.catalogue, {"id": tid, "user": u.name, "scopes": ",".join(sorted(granted)),
                                     "hash": _digest(secret), "created": now,
                                     "expires": now + expires_in if expires_in else None})
    return get(store, tid), f"cap_{tid}_{secret}"


def insert_grant(store: Store, grant: Grant, expires_in: float) -> str:
    """Store a grant (:mod:`capsule.accounts.grants` decides what it may be) expiring in ``expires_in``
    seconds; the token itself (shown once, never stored)."""
    if expires_in <= 0:
        raise InvalidName("a grant's expiry must be in the future")
    tid, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    now = time.time()
    detail = {k: v for k, v in (("uuid", grant.uuid), ("record", grant.record)) if v is not None}
    _insert(store.catalogue, {
        "id": tid, "user": HOST_USER, "scopes": GRANT_SCOPE, "hash": _digest(secret), "created": now,
        "expires": now + expires_in, "allow": grant.allow, "capsule": grant.capsule, "version": grant.version,
        "issuer": grant.issuer, "issuer_token": grant.issuer_token, "detail": json.dumps(detail)})
    return f"cap_{tid}_{secret}"


def get(store: Store, tid: str) -> Token:
    if not isinstance(tid, str) or not _ID_RE.fullmatch(tid):
        raise InvalidName(f"token id {str(tid)[:20]!r}: 12 hex digits, as `capsule token ls` shows")
    rows = store.catalogue.query(_SELECT + " WHERE t.id=?", (tid,))
    if not rows:
        raise NotFound(f"no token {tid} (`capsule token ls`)")
    return _token(rows[0], users.admin_exists(store))


def tokens(store: Store, user: str | None = None) -> list[Token]:
    cat = store.catalogue
    admin = users.admin_exists(store)
    if user is None:
        return [_token(r, admin) for r in cat.query(_SELECT + " ORDER BY t.created")]
    if user != HOST_USER:
        users.get(store, user)
    return [_token(r, admin) for r in cat.query(_SELECT + " WHERE t.user=? ORDER BY t.created", (user,))]


def revoke(store: Store, tid: str) -> Token:
    """Revoke a token, and with it every grant made with it."""
    t = get(store, tid)
    cat = store.catalogue
    with cat.transaction():
        now = time.time()
        cat.query("UPDATE tokens SET revoked=? WHERE id=? AND revoked IS NULL", (now, tid))
        cat.query("UPDATE tokens SET revoked=? WHERE issuer_token=? AND revoked IS NULL", (now, tid))
    return get(store, t.id)


def revoke_issued_by(cat: Catalogue, user: str) -> None:
    """Revoke every grant ``user`` made (the user is being removed)."""
    cat.query("UPDATE tokens SET revoked=? WHERE user=? AND issuer=? AND revoked IS NULL",
                     (time.time(), HOST_USER, user))


def resolve(store: Store, bearer: str, legacy: str | None) -> Principal:
    """The principal a bearer token acts as; :class:`AuthFailed` for anything else."""
    if legacy is not None and hmac.compare_digest(bearer.encode(), legacy.encode()):
        if users.admin_exists(store):
            raise AuthFailed(LEGACY_GONE)
        return legacy_principal()
    m = _TOKEN_RE.fullmatch(bearer)
    if m is None:
        raise AuthFailed("missing or wrong bearer token")
    rows = store.catalogue.query(_SELECT + " WHERE t.id=?", (m[1],))
    if not rows or not hmac.compare_digest(_digest(m[2]), rows[0]["hash"]):
        raise AuthFailed("missing or wrong bearer token")
    row = rows[0]
    legacy_issued = row["allow"] is not None and row["issuer"] == LEGACY_ISSUER
    t = _token(row, users.admin_exists(store) if legacy_issued else False)
    if t.user == HOST_USER:
        if t.grant is None:
            raise AuthFailed(f"token {t.id} is an old host grant that named no capability and never expired: "
                             f"refused (`capsule token revoke {t.id}`; grants are made for one job now)")
        if not t.issuer_live:
            raise AuthFailed(f"grant {t.id} ended with the user or token that made it ({t.grant.issuer})")
        if t.state() != "active":
            raise AuthFailed(f"grant {t.id} is {t.state()}: ask the host that made it for a new one")
        return Principal(HOST_USER, GRANT_ROLE, frozenset(), t.id, t.grant)
    if t.state() != "active":
        raise AuthFailed(f"token {t.id} is {t.state()}: ask an admin for a new one")
    role = row["role"]
    if role is None:
        raise AuthFailed("missing or wrong bearer token")
    return Principal(t.user, role, t.scopes & ROLE_SCOPES[role], t.id)
