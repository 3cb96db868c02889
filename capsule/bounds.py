"""The bounds of capsule's own numbers: what a request, a query parameter or a received version record may
give for each (the rule and the checker are :mod:`hashcache.bounds`; the agent's API types are built from
these in :mod:`capsule.agent.bounded`). A number out of its bounds is refused with :class:`InvalidName`
naming the field, its value and the range, before anything changes."""

from __future__ import annotations

from capsule.errors import InvalidName
from hashcache.bounds import OBJECT_BLOCKS, ZSTD_LEVEL, Bound

__all__ = ["CREATED", "GRANT_SECONDS", "MEMORY_MIB", "OBJECT_BLOCKS", "STOP_TIMEOUT", "TIMEOUT", "VCPUS",
           "VERSION", "WIRE_BYTES", "ZSTD_LEVEL", "Bound", "check"]

# NAME@V: the catalogue's version numbers (a record from a peer says at most nine digits)
VERSION = Bound(1, 10**9 - 1)
# a start's (or activate's) wait for a booting guest: at least a second, at most 15 minutes
TIMEOUT = Bound(1, 900, integer=False, unit="seconds")
# a clean shutdown's wait before the power is cut (0: at once)
STOP_TIMEOUT = Bound(0, 600, integer=False, unit="seconds")
# a machine's vCPUs: what `capsule create --cpus` takes. QEMU's q35 machine takes more, but each vCPU is a host
# thread and a received capsule must not ask a host for more than one made there could
VCPUS = Bound(1, 64)
# a machine's memory: what `capsule create --memory` takes (64M to 1T); QEMU reserves it at start
MEMORY_MIB = Bound(64, 1 << 20, unit="MiB")
# when a version was made, a Unix time (from 1970 to the year 5138)
CREATED = Bound(0, 10**11, integer=False, unit="seconds since 1970")
# bytes a transfer moved, as a peer reports them
WIRE_BYTES = Bound(0, 1 << 62, unit="bytes")
# how long a host-only grant asked for over the network lives: a minute to a day
GRANT_SECONDS = Bound(60, 86400, integer=False, unit="seconds")


def check(bound: Bound, value: object, field: str) -> int | float:
    """``value`` from outside as ``field``, within ``bound``; else :class:`InvalidName` (HTTP 400) saying
    ``field: VALUE is not a whole number from LO to HI``."""
    return bound.check(value, field, InvalidName)
