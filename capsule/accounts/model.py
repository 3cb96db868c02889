"""Roles, scopes and the principal a request acts as.

Roles: ``owner`` acts on the capsules it owns; ``operator`` on all capsules, and may hold host credentials;
``admin`` in addition manages hosts, users and fleet rollouts. Scopes limit what one token may do:

- ``read``: look (listings, info, versions, progress);
- ``capsules``: act on capsules (start, suspend, stop, migrate, back up, restore …), owners only on theirs;
- ``host``: host-to-host calls only (HCP LOOKUP/READ-HASH/READ, push's receiving side, fleet pull, verify and
  prune of backup copies) — the credential one agent gives another;
- ``admin``: users, tokens, hosts and fleet rollouts.

A *grant* is not a role: it is a capability this host hands a peer for one job — read the objects of one
capsule (or one version of it), or receive one push of one version — that expires, and ends with the user or
token that made it (:mod:`capsule.accounts.grants`). A request made with one acts as a principal of role
``grant`` carrying the :class:`Grant`; no role or scope of a user applies to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from capsule.errors import InvalidName

ROLES = ("owner", "operator", "admin")
SCOPES = ("read", "capsules", "host", "admin")
ROLE_SCOPES: dict[str, frozenset[str]] = {
    "owner": frozenset({"read", "capsules"}),
    "operator": frozenset({"read", "capsules", "host"}),
    "admin": frozenset(SCOPES),
}
_USER_RE = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")
LEGACY = "host-token"    # how the audit log names the old single token


_DURATION = re.compile(r"([0-9]{1,6})([hdw])")


def parse_duration(text: str) -> float:
    """``12h``, ``30d``, ``8w`` → seconds."""
    m = _DURATION.fullmatch(text.strip())
    if m is None or int(m[1]) == 0:
        raise InvalidName(f"--expires {text[:20]!r}: give hours, days or weeks, e.g. 12h, 30d, 8w")
    return int(m[1]) * {"h": 3600, "d": 86400, "w": 7 * 86400}[m[2]]


def check_user(name: str) -> str:
    if not isinstance(name, str) or not _USER_RE.fullmatch(name):
        raise InvalidName(f"user name {str(name)[:40]!r}: use 1-32 characters, lower-case letters, digits, "
                          "'_', '.', '-', starting with a letter or '_'")
    return name


def check_role(role: str) -> str:
    if role not in ROLES:
        raise InvalidName(f"role {str(role)[:20]!r}: choose one of {', '.join(ROLES)}")
    return role


def parse_scopes(scopes: list[str] | str, role: str) -> frozenset[str]:
    """Scopes given as a list or a comma-separated string, checked against what ``role`` may hold."""
    items = scopes.split(",") if isinstance(scopes, str) else [s for x in scopes for s in x.split(",")]
    got = frozenset(s.strip() for s in items if s.strip())
    if not got:
        raise InvalidName(f"give at least one scope: {', '.join(SCOPES)}")
    unknown = sorted(got - set(SCOPES))
    if unknown:
        raise InvalidName(f"unknown scope {unknown[0][:20]!r}: choose from {', '.join(SCOPES)}")
    denied = sorted(got - ROLE_SCOPES[role])
    if denied:
        raise InvalidName(f"a user of role {role} cannot hold scope {denied[0]!r} (it may hold "
                          f"{', '.join(s for s in SCOPES if s in ROLE_SCOPES[role])})")
    return got


READ, PUSH = "read", "push"
CAPABILITIES = (READ, PUSH)
GRANT_ROLE = "grant"


@dataclass(frozen=True)
class Grant:
    """What one grant allows: ``read`` the objects of ``capsule`` (of its ``version`` only, if one is named),
    or ``push`` the version ``record`` names (its objects, then that record and no other). ``uuid``: the
    capsule a read grant was made for (one removed and made again under its name is another capsule).
    ``issuer``: who made it (a user, ``host-token`` or ``unix:NAME``), with ``issuer_token`` (a token id)."""

    allow: str
    capsule: str
    version: int | None
    issuer: str
    issuer_token: str | None = None
    uuid: str | None = None
    record: dict[str, Any] | None = None

    def describe(self) -> str:
        return f"{self.allow} {self.capsule}{'' if self.version is None else f'@{self.version}'}"

    def as_dict(self) -> dict[str, object]:
        return {"allow": self.allow, "capsule": self.capsule, "version": self.version, "issuer": self.issuer,
                "issuer_token": self.issuer_token}


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: a user (with a token or a password session) or the legacy host token."""

    user: str | None            # None: the legacy host token
    role: str
    scopes: frozenset[str]
    token_id: str | None = None
    grant: Grant | None = None  # a grant's capability (then ``role`` is ``grant`` and ``scopes`` is empty)

    @property
    def who(self) -> str:
        if self.user is None:
            return LEGACY
        return f"{self.user}/{self.token_id}" if self.token_id else self.user

    def sees_all(self) -> bool:
        return self.role in ("operator", "admin")

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"user": self.user, "role": self.role, "scopes": sorted(self.scopes),
                                  "token": self.token_id}
        if self.grant is not None:
            out["grant"] = self.grant.as_dict()
        return out


def legacy_principal() -> Principal:
    return Principal(None, "admin", ROLE_SCOPES["admin"])
