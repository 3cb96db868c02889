"""Parsing and validation of the names users type: capsules, images,
versions (``NAME@V``) and object ids (64 hex digits)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from capsule.errors import InvalidName

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_OBJECT_ID_RE = re.compile(r"^[0-9a-f]{64}$")


def check_name(name: str, what: str = "capsule") -> str:
    """Return ``name`` if it is a valid capsule or image name, else raise."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise InvalidName(
            f"invalid {what} name {name!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_object_id(object_id: str, what: str = "object") -> str:
    """Return ``object_id`` if it is a well-formed 64-hex-digit digest, else raise."""
    if not isinstance(object_id, str) or not _OBJECT_ID_RE.match(object_id):
        raise InvalidName(f"malformed {what} id {object_id!r}: expected 64 lowercase hex digits")
    return object_id


@dataclass(frozen=True)
class VersionRef:
    """``NAME`` (the latest version) or ``NAME@V``."""

    name: str
    version: int | None = None

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


def parse_ref(text: str) -> VersionRef:
    """Parse ``NAME`` or ``NAME@V`` (V a positive integer)."""
    if not isinstance(text, str):
        raise InvalidName(f"invalid capsule reference {text!r}")
    name, sep, ver = text.partition("@")
    check_name(name)
    if not sep:
        return VersionRef(name)
    if not ver.isdigit() or len(ver) > 9 or int(ver) < 1:
        raise InvalidName(f"invalid version in {text!r}: expected NAME@N with N a positive integer")
    return VersionRef(name, int(ver))
