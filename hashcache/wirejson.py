"""JSON from outside (a peer, a guest, a file): one decoder whose every failure is a ValueError.

``json.loads`` raises ``RecursionError`` (not a ``ValueError``) for deeply nested input such as
``[[[[…]]]]`` a few thousand levels deep, and ``ValueError`` for an integer of more than 4300 digits;
callers that map ``ValueError`` to their own typed error would let the first escape as an internal
error. :func:`loads` turns it into a ``ValueError`` with a message a user can act on.

It also takes only what JSON is: ``json.loads`` reads ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON),
and a number like ``1e400`` as infinity. A NaN compares false with every bound, so ``min(max(nan, 1), 900)``
is NaN and a wait on it never ends. Here each of them is a ``ValueError``: every number from outside is
finite (its bounds are checked where it is used, :mod:`hashcache.bounds`).
"""

from __future__ import annotations

import json
import math
from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (give a finite number)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range (give a finite number)")
    return value


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads``, but too deep nesting, NaN, Infinity and floats beyond a double's range raise
    ``ValueError`` too (UnicodeDecodeError is one already)."""
    try:
        return json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
