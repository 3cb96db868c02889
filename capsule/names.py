"""Parsing and validation of the names users type and peers send: capsules,
images, versions (``NAME@V``), object ids (64 hex digits) and uuids.

Every check matches the *whole* string (``re.fullmatch``): ``$`` alone would
let a trailing newline through (``"demo\\n"``). Character classes spell out
ASCII ranges, so no other script's letters or digits pass either."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from capsule.errors import InvalidName

NAME_MAX = 63
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_OBJECT_ID_RE = re.compile(r"[0-9a-f]{64}")
_VERSION_RE = re.compile(r"[1-9][0-9]{0,8}")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def check_name(name: str, what: str = "capsule") -> str:
    """Return ``name`` if it is a valid capsule or image name, else raise."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidName(
            f"invalid {what} name {name!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_object_id(object_id: str, what: str = "object") -> str:
    """Return ``object_id`` if it is a well-formed 64-hex-digit digest, else raise."""
    if not isinstance(object_id, str) or not _OBJECT_ID_RE.fullmatch(object_id):
        raise InvalidName(f"malformed {what} id {object_id!r}: expected 64 lowercase hex digits")
    return object_id


def check_uuid(value: str, what: str = "uuid") -> str:
    """Return ``value`` if it is a uuid in canonical form (lowercase, hyphenated), else raise."""
    if not isinstance(value, str) or not _UUID_RE.fullmatch(value):
        raise InvalidName(f"malformed {what} {value!r}: expected a lowercase uuid like "
                          "'123e4567-e89b-12d3-a456-426614174000'")
    return value


def check_host(host: str, what: str = "host") -> str:
    """Return ``host`` if it is an IP address or a DNS host name (ASCII letters, digits, '-',
    dot-separated labels of at most 63, at most 253 in all), else raise."""
    if isinstance(host, str) and len(host) <= 253:
        try:
            ipaddress.ip_address(host)
            return host
        except ValueError:
            if _HOSTNAME_RE.fullmatch(host):
                return host
    raise InvalidName(f"invalid {what} {host!r}: expected an IP address or a host name "
                      "(letters, digits, '-' and dots)")


@dataclass(frozen=True)
class VersionRef:
    """``NAME`` (the latest version) or ``NAME@V``."""

    name: str
    version: int | None = None

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


def parse_ref(text: str) -> VersionRef:
    """Parse ``NAME`` or ``NAME@V`` (V a positive integer in ASCII digits, no leading zero,
    below 10**9), so each version has one spelling and ``str(parse_ref(s)) == s``."""
    if not isinstance(text, str):
        raise InvalidName(f"invalid capsule reference {text!r}")
    name, sep, ver = text.partition("@")
    check_name(name)
    if not sep:
        return VersionRef(name)
    if not _VERSION_RE.fullmatch(ver):
        raise InvalidName(f"invalid version in {text!r}: expected NAME@N with N a positive integer "
                          "(digits 0-9, no leading zero)")
    return VersionRef(name, int(ver))
