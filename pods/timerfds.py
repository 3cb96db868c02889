"""Periodic timerfds that were due, unread, at a checkpoint: running again after the restore.

A periodic timerfd whose expiry has come and not been read is, in the kernel, expired with its timer stopped
(the next read forwards it by its interval and restarts it). CRIU dumps it as it shows in fdinfo — ``ticks``
pending, ``it_value`` 0, ``it_interval`` the period — and restores it with ``timerfd_settime`` of a zero value,
which leaves it disarmed: the pending expiry reads once, then it never fires again (criu issue #3162).

After CRIU's restore, :func:`rearm` finds each such timerfd of the pod's processes (``ticks`` > 0, ``it_value``
0, ``it_interval`` not 0: fdinfo cannot tell it from one that expired unread just now, but right after a
restore it is one CRIU restored), takes a copy of it
(``pidfd_getfd``: the same open file), arms it again with its period, and puts its pending expiries back
(``TFD_IOC_SET_TICKS``, which CRIU itself uses). The restored programs are already running then, but a
program that had left the expiry unread until the checkpoint is not reading it in those milliseconds."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import struct
from collections.abc import Iterable

SYS_PIDFD_OPEN = 434     # x86-64
SYS_PIDFD_GETFD = 438
TFD_IOC_SET_TICKS = 0x40085400   # _IOW('T', 0, __u64)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _pair(text: str) -> tuple[int, int]:
    """``(0, 200000000)`` → (0, 200000000)."""
    sec, nsec = text.strip().strip("()").split(",")
    return int(sec), int(nsec)


def due_periodic(pid: int) -> list[tuple[int, int, tuple[int, int]]]:
    """(fd, pending expiries, period) of each periodic timerfd of ``pid`` that is expired and unread."""
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/fdinfo"):
            try:
                with open(f"/proc/{pid}/fdinfo/{name}") as f:
                    info = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in f if ":" in ln)}
                if "it_interval" not in info or "ticks" not in info:
                    continue                      # no timerfd
                ticks, value, interval = int(info["ticks"]), _pair(info["it_value"]), _pair(info["it_interval"])
            except (OSError, ValueError):
                continue
            if ticks > 0 and value == (0, 0) and interval != (0, 0):
                found.append((int(name), ticks, interval))
    return found


def rearm(pids: Iterable[int]) -> int:
    """Arm again every due periodic timerfd of ``pids`` (see the module); returns how many. Best effort: a
    process gone, or a call the kernel refuses, leaves that timerfd as CRIU restored it."""
    libc = ctypes.CDLL(None, use_errno=True)
    done = 0
    for pid in pids:
        found = due_periodic(pid)
        if not found:
            continue
        pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
        if pidfd < 0:
            continue
        try:
            for fd, ticks, (sec, nsec) in found:
                mine = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
                if mine < 0:
                    continue
                try:
                    period = _Timespec(sec, nsec)
                    if libc.timerfd_settime(mine, 0, ctypes.byref(_Itimerspec(period, period)), None) != 0:
                        continue
                    fcntl.ioctl(mine, TFD_IOC_SET_TICKS, struct.pack("<Q", ticks))   # settime cleared them
                    done += 1
                except OSError:
                    continue
                finally:
                    os.close(mine)
        finally:
            os.close(pidfd)
    return done
