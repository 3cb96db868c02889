"""Helpers for tests that drive real guests."""

from __future__ import annotations

import time

from capsule.console.serial import ConsoleSession
from capsule.store import Store

# counts in /tmp/count five times a second. Each count overwrites the last in place (`1<>` does not
# truncate, and the numbers only grow longer), so a reader never finds the file empty: not between two
# writes, and not in a guest or pod frozen or checkpointed there.
COUNT_LOOP = "i=0; : > /tmp/count; while true; do i=$((i+1)); echo $i 1<> /tmp/count; sleep 0.2; done"
COUNTER = f"({COUNT_LOOP}) >/dev/null 2>&1 &"


def guest(store: Store, capsule: str) -> ConsoleSession:
    return ConsoleSession(store.domain_name(capsule))


def run(store: Store, capsule: str, command: str, timeout: float = 60.0) -> str:
    with guest(store, capsule) as c:
        return c.run(command, timeout=timeout)


def uptime(store: Store, capsule: str) -> float:
    return float(run(store, capsule, "cat /proc/uptime").split()[0])


def count(store: Store, capsule: str) -> int:
    return int(run(store, capsule, "cat /tmp/count"))


def wait_count_above(store: Store, capsule: str, n: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        c = count(store, capsule)
        if c > n or time.monotonic() > deadline:
            return c
        time.sleep(0.3)


def write_blocks(store: Store, capsule: str, seek: int, count: int) -> None:
    """Overwrite ``count`` 4 KiB blocks at block ``seek`` of /dev/vda with random data."""
    run(store, capsule, f"dd if=/dev/urandom of=/dev/vda bs=4096 seek={seek} count={count} "
                        f"conv=notrunc 2>/dev/null; sync")


def disk_digest(store: Store, capsule: str, blocks: int = 2048) -> str:
    """sha256 of the first ``blocks`` 4 KiB blocks of /dev/vda as the guest reads them."""
    out = run(store, capsule, f"echo 3 > /proc/sys/vm/drop_caches; "
                              f"dd if=/dev/vda bs=4096 count={blocks} 2>/dev/null | sha256sum")
    return out.split()[0]
