"""What every fuzz test (tests/unit/test_fuzz_*.py) shares: the Hypothesis profiles, the marks, and
strategies that turn valid inputs into hostile ones.

Two profiles: ``ci`` (the default, what ``make test`` runs: a bounded number of examples, the unit
tier's 60 s timeout) and ``fuzz`` (``HYPOTHESIS_PROFILE=fuzz``, what ``make fuzz`` runs: many more
examples and a timeout to match). Neither keeps an example database on disk, and neither has a
wall-clock deadline per example (the machine may be shared and slow at times): a hang is caught by
the test's timeout instead.

The property every parser must keep: bytes from outside give either a valid object or the project's
typed error (``hashcache.errors.Error`` or the parser's own subclass), never another exception."""

from __future__ import annotations

import contextlib
import os
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=200, deadline=None, database=None, suppress_health_check=_HEALTH)
settings.register_profile("fuzz", max_examples=20_000, deadline=None, database=None,
                          suppress_health_check=_HEALTH)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "fuzz"):
    raise RuntimeError(f"HYPOTHESIS_PROFILE={PROFILE!r}: use ci (the default) or fuzz")

# the decorator every fuzz test uses; fuzz_files for tests that write a file per example (a quarter as many)
fuzz = settings.get_profile(PROFILE)
fuzz_files = settings(fuzz, max_examples=max(1, fuzz.max_examples // 4))
# a fuzz module's pytestmark: the unit tier, and in the fuzz profile a timeout long enough for its examples
MARKS = [pytest.mark.unit] + ([pytest.mark.timeout(3600)] if PROFILE == "fuzz" else [])

# -- hostile variations of valid bytes ---------------------------------------------------------------

# integers a length or count field is most likely to mishandle
EDGE_INTS = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF,
             0x7FFF_FFFF_FFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF]


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes], max_steps: int = 4) -> bytes:
    """``valid`` bytes changed by a few mutations: bit flips, truncations, inserted or deleted bytes,
    a 4- or 8-byte little-endian field overwritten with an edge value (huge lengths, -1, 2^63)."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, max_steps))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "int32", "int64", "byte"]))
        pos = draw(st.integers(0, max(0, len(data))))
        if op == "flip" and data:
            pos = min(pos, len(data) - 1)
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 16))]
        elif op in ("int32", "int64"):
            fmt, mask = ("<I", 0xFFFF_FFFF) if op == "int32" else ("<Q", 0xFFFF_FFFF_FFFF_FFFF)
            value = draw(st.sampled_from(EDGE_INTS) | st.integers(0, mask)) & mask
            data[pos:pos + struct.calcsize(fmt)] = struct.pack(fmt, value)
        elif op == "byte" and data:
            pos = min(pos, len(data) - 1)
            data[pos] = draw(st.sampled_from([0x00, 0x0A, 0x22, 0x5B, 0x7B, 0x7F, 0x80, 0xC0, 0xFF]))
    return bytes(data)


def hostile(valid: st.SearchStrategy[bytes], max_size: int = 512) -> st.SearchStrategy[bytes]:
    """Garbage, or valid bytes mutated (most of the examples: they get past the first checks)."""
    return st.one_of(st.binary(max_size=max_size), mutated(valid), mutated(valid), mutated(valid))


# JSON values of any shape (what a peer can put where an object is expected)
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(
    max_size=40)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=12), inner, max_size=4), max_leaves=12)


def deep_json(depth: int = 5000) -> bytes:
    """Nesting deeper than Python's recursion limit: ``json.loads`` raises RecursionError on it."""
    return b"[" * depth + b"]" * depth


def peak_allocation(fn: Callable[[], Any]) -> int:
    """Bytes allocated at the peak while ``fn`` runs (its exception, if any, is swallowed)."""
    tracemalloc.start()
    try:
        with contextlib.suppress(Exception):  # only the memory is measured here
            fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
