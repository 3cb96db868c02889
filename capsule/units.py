"""Sizes as users type and read them."""

from __future__ import annotations

import re

from capsule.bounds import MEMORY_MIB
from capsule.errors import InvalidName

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'512M', '1G', '256MiB', '1048576' → bytes."""
    # re.ASCII: \d alone also takes other scripts' digits ('١٢٨M' would be 128M)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text), re.ASCII)
    if not m:
        raise InvalidName(f"invalid size {text!r}: use e.g. 512M or 2G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_memory_mib(text: str) -> int:
    size = parse_size(text)
    if size < 1 << 20 and re.fullmatch(r"\s*\d+\s*", str(text), re.ASCII):
        size <<= 20  # a bare number means MiB
    mib = size >> 20
    if not MEMORY_MIB.contains(mib):
        raise InvalidName(f"memory {text!r} out of range: give between 64M and 1T")
    return mib


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
