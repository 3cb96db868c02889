"""Numbers from outside — a peer's reply, a request's field or query parameter — are finite, of the right
kind and within bounds, or refused with a typed error naming the field, its value and the range.

One rule for every number that crosses the network:

- a whole-number field takes an integer only: not a bool (``True`` is an ``int`` in Python), not a float
  (``3.0``), not a string;
- a real-valued field takes an integer or a finite float: not NaN, not ±Infinity, not a bool;
- either must lie in its :class:`Bound` (both ends included);
- text (a query parameter) is read as plain ASCII decimal digits — no ``nan``, ``inf``, ``1_000`` or other
  scripts' digits — and then checked as above.

The wire decoders call :meth:`Bound.check` (``error`` is their own typed error class, e.g. the HCP decoders'
``ProtocolError`` or capsule's ``InvalidName``); the agent's request models and query parameters are built
from the same :class:`Bound` objects (``capsule.agent.bounded``), so a route and a decoder say the same thing
about the same quantity. JSON itself carries no NaN or Infinity here: :func:`hashcache.wirejson.loads`
refuses them.

The bounds of what hashcache knows live here (objects, blocks, zstd levels); capsule's own quantities
(versions, timeouts, vCPUs, memory) live in ``capsule.bounds``.
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass

from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import Error, InvalidInput

SHOWN = 40  # characters of a refused value repeated in the message

_INT_TEXT = re.compile(r"[+-]?[0-9]{1,30}", re.ASCII)
_REAL_TEXT = re.compile(r"[+-]?(?:[0-9]{1,30}(?:\.[0-9]{0,30})?|\.[0-9]{1,30})(?:[eE][+-]?[0-9]{1,4})?", re.ASCII)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, SHOWN, SHOWN


def shown(value: object) -> str:
    """``value`` as a message repeats it: its repr, cut to about :data:`SHOWN` characters without making the
    whole of a long one first (a huge integer by its size: its decimal form may be too long to make)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > 4 * SHOWN:
            return f"an integer of {value.bit_length()} bits"
        return repr(value)
    text = _REPR.repr(value)
    return text if len(text) <= SHOWN + 8 else text[:SHOWN - 3] + "..."


@dataclass(frozen=True)
class Bound:
    """The values one quantity may take: ``lo`` to ``hi`` (both included), whole numbers only (``integer``)
    or any finite number; ``unit`` is said in messages (``"seconds"``, ``"MiB"``)."""

    lo: int | float
    hi: int | float
    integer: bool = True
    unit: str = ""

    def describe(self) -> str:
        """E.g. ``a whole number from 1 to 64`` or ``a number from 1 to 900 (seconds)``."""
        kind = "a whole number" if self.integer else "a number"
        unit = f" ({self.unit})" if self.unit else ""
        return f"{kind} from {_num(self.lo)} to {_num(self.hi)}{unit}"

    def problem(self, value: object) -> str:
        """What is wrong with ``value`` (without the field's name)."""
        return f"{shown(value)} is not {self.describe()}"

    def contains(self, value: object) -> bool:
        """Whether :meth:`check` would take ``value`` (a JSON value, not text)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(value, float) and (self.integer or not math.isfinite(value)):
            return False
        return self.lo <= value <= self.hi

    def check(self, value: object, field: str, error: type[Error] = InvalidInput) -> int | float:
        """``value`` (a JSON value from outside) as this quantity: an ``int`` for a whole-number bound, a
        ``float`` otherwise; else ``error`` saying ``field: VALUE is not a whole number from LO to HI``."""
        if not self.contains(value):
            raise error(f"{field}: {self.problem(value)}")
        assert isinstance(value, int | float)
        return int(value) if self.integer else float(value)

    def check_int(self, value: object, field: str, error: type[Error] = InvalidInput) -> int:
        """:meth:`check` of a whole-number bound, typed as the ``int`` it then returns."""
        assert self.integer, "check_int of a bound that takes any number"
        return int(self.check(value, field, error))

    def parse(self, text: str) -> int | float | None:
        """The number ``text`` spells in plain ASCII decimal (a query parameter), if it is one and in bounds;
        else None."""
        if not isinstance(text, str):
            return None
        text = text.strip()
        if _INT_TEXT.fullmatch(text):
            value: int | float = int(text)
        elif not self.integer and _REAL_TEXT.fullmatch(text):
            value = float(text)
        else:
            return None
        return (int(value) if self.integer else float(value)) if self.contains(value) else None

    def check_text(self, text: str, field: str, error: type[Error] = InvalidInput) -> int | float:
        """:meth:`parse`, or ``error`` naming the field, the text and the range."""
        value = self.parse(text)
        if value is None:
            raise error(f"{field}: {self.problem(text)}")
        return value


def _num(x: int | float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


# -- what hashcache knows ------------------------------------------------------------------------------

MAX_OBJECT_SIZE = (1 << 50) - 1          # bytes of one layer or file object (a PiB: far over any disk)
OBJECT_SIZE = Bound(0, MAX_OBJECT_SIZE, unit="bytes")
OBJECT_BLOCKS = Bound(0, -(-MAX_OBJECT_SIZE // BLOCK_SIZE))   # block indices, record counts, segment numbers
ZSTD_LEVEL = Bound(1, 19)                # the levels the agents compress at (zstd's 20..22 need far more memory)
HTTP_ERROR = Bound(400, 599)             # the status of a refusal


def blocks_in(size: int) -> Bound:
    """Record counts (or block indices + 1) an object of ``size`` bytes can have: 0 to its block count."""
    return Bound(0, -(-size // BLOCK_SIZE))
