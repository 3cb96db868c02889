"""Which repository locks are a dead writer's (capsule.repo.repository.stale), restic's rules: not refreshed for
30 minutes, or taken on this host by a process that is gone; a lock of another host is judged by its age only."""

from __future__ import annotations

import os
import socket

import pytest

from capsule.repo.repository import STALE_LOCK_SECONDS, stale

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

HERE = socket.gethostname()
NOW = 1_800_000_000.0
GONE = 2 ** 22 + 12345          # above the kernel's largest pid: no process has it


def test_a_lock_is_stale_when_old_or_its_process_here_is_gone():
    fresh = {"host": HERE, "pid": os.getpid(), "time": NOW}
    assert not stale(fresh, NOW)
    assert stale(fresh, NOW + STALE_LOCK_SECONDS + 1)                  # not refreshed for half an hour
    assert stale(fresh | {"pid": GONE}, NOW)                          # here, and its process is gone
    assert not stale(fresh | {"host": "elsewhere", "pid": GONE}, NOW)  # another host's: its age only
    assert stale(fresh | {"host": "elsewhere"}, NOW + STALE_LOCK_SECONDS + 1)
    for pid in (None, "123", 0, -1, True, 1.5):
        assert not stale(fresh | {"pid": pid}, NOW), pid               # no pid to judge by: its age only
    for when in (None, "soon", [], float("nan"), float("inf")):
        assert stale(fresh | {"time": when}, NOW), when                # no time to judge by: it holds nothing
