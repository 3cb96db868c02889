"""The agent's bounded numbers as request types: a JSON body field (:func:`field`) or a query parameter
(:func:`query`) whose value is checked by its :class:`~hashcache.bounds.Bound` — the same rule and the same
message as the wire decoders (:mod:`hashcache.bounds`): no NaN or Infinity, no bool for a whole number, no
string in a JSON body, only plain decimal in a query, and within range. A refusal is a request validation
error, which the agent answers like every malformed request (400 ``invalid_name``, the field, the value and
the range in its detail); the OpenAPI schema says the range.

    TimeoutQuery = query(TIMEOUT)           # a type, made once, below
    def start(name: str, timeout: TimeoutQuery = 180.0) -> …      # ?timeout=
    class StartIn(BaseModel):
        version: Version | None = None                             # {"version": …}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from capsule.bounds import STOP_TIMEOUT, TIMEOUT, VERSION
from capsule.exchange.receiving import MAX_PARTS
from capsule.exchange.serving import MAX_RECORDS
from hashcache.bounds import OBJECT_BLOCKS, ZSTD_LEVEL, Bound
from hashcache.hcp import PREFIX_SIZE
from hashcache.manifest import RECORD_SIZE

ERROR_TYPE = "out_of_bounds"


def _refuse(bound: Bound, value: object) -> PydanticCustomError:
    return PydanticCustomError(ERROR_TYPE, "{problem}", {"problem": bound.problem(value)})


def _schema(bound: Bound) -> dict[str, Any]:
    if bound.integer:
        return {"type": "integer", "minimum": int(bound.lo), "maximum": int(bound.hi)}
    return {"type": "number", "minimum": bound.lo, "maximum": bound.hi}


def field(bound: Bound) -> Any:
    """The type of a JSON body field within ``bound`` (a JSON number only: ``"5"`` and ``true`` are refused)."""
    def validate(value: object) -> int | float:
        if not bound.contains(value):
            raise _refuse(bound, value)
        assert isinstance(value, int | float)
        return int(value) if bound.integer else float(value)

    base = int if bound.integer else float
    return Annotated[base, PlainValidator(validate), WithJsonSchema(_schema(bound))]


def query(bound: Bound) -> Any:
    """The type of a query parameter within ``bound`` (its text in plain ASCII decimal)."""
    def validate(value: object) -> int | float:
        parsed = bound.parse(value) if isinstance(value, str) else None
        if parsed is None:
            raise _refuse(bound, value)
        return parsed

    base = int if bound.integer else float
    return Annotated[base, PlainValidator(validate), WithJsonSchema(_schema(bound))]


# -- the agent's numbers -------------------------------------------------------------------------------
Version = field(VERSION)                    # NAME@V in a body
VersionQuery = query(VERSION)               # ?version=
Timeout = field(TIMEOUT)                    # a start's wait
TimeoutQuery = query(TIMEOUT)
StopTimeout = field(STOP_TIMEOUT)
ZstdLevelQuery = query(ZSTD_LEVEL)          # ?level= of READ
RecordStartQuery = query(OBJECT_BLOCKS)     # ?start= of READ-HASH (a record index)
RecordCountQuery = query(Bound(0, MAX_RECORDS))
HashLenQuery = query(Bound(PREFIX_SIZE, RECORD_SIZE - 8))   # 8 or 32: the library refuses the others
SegmentQuery = query(OBJECT_BLOCKS)         # ?seq= of a block stream (at most one segment per block)
PartQuery = query(Bound(0, MAX_PARTS - 1))  # ?part= and ?parts= of a manifest upload
PartsQuery = query(Bound(1, MAX_PARTS))
