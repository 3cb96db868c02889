"""pods/timerfds.py on this machine's own kernel, in this process: a periodic timerfd that expired unread (the
state CRIU restores disarmed) is found by its fdinfo and armed again through a pidfd copy, its pending expiry
kept; one disarmed by its program, or still running, is left alone."""

from __future__ import annotations

import ctypes
import os
import select
import time

import pytest

from pods import timerfds

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

libc = ctypes.CDLL(None, use_errno=True)
CLOCK_MONOTONIC = 1


def _timerfd(value: float, interval: float) -> int:
    fd = libc.timerfd_create(CLOCK_MONOTONIC, 0)
    assert fd >= 0
    spec = timerfds._Itimerspec(timerfds._Timespec(int(interval), int(interval % 1 * 1e9)),
                                timerfds._Timespec(int(value), int(value % 1 * 1e9)))
    assert libc.timerfd_settime(fd, 0, ctypes.byref(spec), None) == 0
    return fd


def _info(fd: int) -> dict[str, str]:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in f if ":" in ln)}


def test_a_due_periodic_timerfd_is_armed_again_with_its_pending_expiry():
    due = _timerfd(0.05, 0.05)
    running = _timerfd(60, 60)                      # armed, not due: left alone
    stopped = _timerfd(0, 0.05)                     # disarmed by its program (a zero value): left alone
    try:
        deadline = time.monotonic() + 10
        while int(_info(due)["ticks"]) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _info(due)["it_value"] == "(0, 0)"   # expired, unread: stopped until a read
        found = timerfds.due_periodic(os.getpid())
        assert [(fd, interval) for fd, _t, interval in found] == [(due, (0, 50_000_000))]
        assert timerfds.rearm([os.getpid()]) == 1
        info = _info(due)
        assert info["it_value"] != "(0, 0)" and int(info["ticks"]) >= 1   # running again, its expiry kept
        pending = int.from_bytes(os.read(due, 8), "little")
        assert pending >= 1
        assert select.select([due], [], [], 2.0)[0] == [due]              # and it fires at its period
        assert _info(running)["it_value"] != "(0, 0)" and _info(stopped)["it_value"] == "(0, 0)"
        assert {fd for fd, _t, _i in timerfds.due_periodic(os.getpid())} <= {due}   # never the other two
    finally:
        for fd in (due, running, stopped):
            os.close(fd)


def test_fdinfo_pairs_and_a_process_that_is_gone():
    assert timerfds._pair("(3, 200000000)") == (3, 200_000_000)
    assert timerfds.due_periodic(2 ** 22 + 12345) == []                 # no such process: nothing found
    assert timerfds.rearm([2 ** 22 + 12345]) == 0
