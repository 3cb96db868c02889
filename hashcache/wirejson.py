"""JSON from outside (a peer, a guest, a file): one decoder whose every failure is a ValueError.

``json.loads`` raises ``RecursionError`` (not a ``ValueError``) for deeply nested input such as
``[[[[…]]]]`` a few thousand levels deep, and ``ValueError`` for an integer of more than 4300 digits;
callers that map ``ValueError`` to their own typed error would let the first escape as an internal
error. :func:`loads` turns it into a ``ValueError`` with a message a user can act on.
"""

from __future__ import annotations

import json
from typing import Any


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads``, but too deep nesting raises ``ValueError`` too (UnicodeDecodeError is one already)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
