"""The store lock: one holder at a time, across threads and processes.

Two layers, taken in this order:

- a process-wide ``threading.Lock`` per store directory, so two threads of
  one process (the agent's workers) never hold the store at once, whichever
  ``Store`` object they use;
- ``flock`` on ``<store>/.lock``, so other processes (``capsule gc`` while the
  agent commits a push) are excluded too.

Re-entry is counted per thread: a thread that holds the lock may take it again
(``snapshot`` calls ``suspend`` and ``start``), another thread waits.

The lock file records its holder (host, pid, thread, command, since), like
borg's lock, so a wait that times out names who holds the store. There is no
stale lock to break: the kernel drops a ``flock`` when its holder dies, and the
record of a dead holder is simply overwritten by the next one.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from capsule.errors import Conflict

DEFAULT_TIMEOUT = 3600.0      # seconds; CAPSULE_LOCK_TIMEOUT overrides (0: wait forever)
POLL = 0.05


class LockTimeout(Conflict):
    """The store stayed locked by someone else for longer than we were willing to wait."""


def _timeout_from_env() -> float | None:
    raw = os.environ.get("CAPSULE_LOCK_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_TIMEOUT
    return None if value <= 0 else value


class StoreLock:
    """The lock of one store directory. Get it with ``lock_for(home)``: one per directory and process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mutex = threading.Lock()
        self._local = threading.local()

    @property
    def depth(self) -> int:
        """How many times the calling thread holds this lock (0: not at all)."""
        return getattr(self._local, "depth", 0)

    def held_by_me(self) -> bool:
        return self.depth > 0

    @contextmanager
    def hold(self, timeout: float | None = -1.0, purpose: str = "") -> Iterator[None]:
        """Hold the lock for the ``with`` block. ``timeout`` in seconds (None: forever; the default
        reads CAPSULE_LOCK_TIMEOUT); raises ``LockTimeout`` naming the holder when it runs out."""
        if self.depth:
            self._local.depth += 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        if timeout is not None and timeout < 0:
            timeout = _timeout_from_env()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._mutex.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise self._timed_out(timeout)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                self._flock(fd, deadline, timeout)
                try:
                    self._write_holder(fd, purpose)
                    self._local.depth = 1
                    try:
                        yield
                    finally:
                        self._local.depth = 0
                        with suppress(OSError):
                            os.ftruncate(fd, 0)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        finally:
            self._mutex.release()

    def _flock(self, fd: int, deadline: float | None, timeout: float | None) -> None:
        if deadline is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise self._timed_out(timeout) from None
                time.sleep(POLL)

    def _write_holder(self, fd: int, purpose: str) -> None:
        t = threading.current_thread()
        record = {"host": socket.gethostname(), "pid": os.getpid(), "thread": t.name, "thread_id": t.ident,
                  "command": " ".join(sys.argv[:3])[:200], "purpose": purpose, "since": time.time()}
        with suppress(OSError):  # only a help for the curious: a full disk must not stop gc and rm
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)

    def holder(self) -> dict[str, Any] | None:
        """Who holds the lock now, as recorded in the lock file (None when nobody does: a record
        left by a holder that was killed is stale, since the kernel dropped its lock)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass                                  # held: the record is current
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
                return None
            text = os.pread(fd, 4096, 0).decode(errors="replace")
        finally:
            os.close(fd)
        try:
            record = json.loads(text) if text.strip() else None
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    def _timed_out(self, timeout: float | None) -> LockTimeout:
        return LockTimeout(f"the store {self.path.parent} stayed locked for {timeout:.0f} s "
                           f"by {describe_holder(self.holder())}; try again when it is done "
                           "(CAPSULE_LOCK_TIMEOUT sets how long to wait, 0 = forever)")


def describe_holder(record: dict[str, Any] | None) -> str:
    if not record:
        return "another thread of this process or a process that has not recorded itself yet"
    since = record.get("since")
    when = time.strftime("%H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    what = record.get("purpose") or record.get("command") or "?"
    return (f"pid {record.get('pid')} on {record.get('host')} (thread {record.get('thread')}, "
            f"{what!s}) since {when}")


_registry: dict[str, StoreLock] = {}
_registry_lock = threading.Lock()


def lock_for(home: Path) -> StoreLock:
    """The one ``StoreLock`` of the store at ``home`` in this process."""
    key = os.path.realpath(home)
    with _registry_lock:
        lock = _registry.get(key)
        if lock is None:
            lock = _registry[key] = StoreLock(Path(key) / ".lock")
        return lock


def _reset_after_fork() -> None:
    # a forked child holds none of its parent's locks (and must not inherit a mutex taken by another thread)
    global _registry_lock
    _registry.clear()
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
