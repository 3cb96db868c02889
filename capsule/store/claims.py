"""Claims: one operation at a time on one capsule, without holding the whole store.

The store lock (``locks.py``) is held only while the catalogue or the store's files change, never while
a guest is waited for. An operation that also waits on its guest — a stop's ACPI shutdown, a suspend's
balloon and save, a disk-only backup's freeze — first *claims* its capsule and keeps the claim over all its
steps, taking the store lock only around the changes. Another operation on the same capsule meanwhile is
refused at once (:class:`CapsuleBusy`: "capsule 'web' is stopping"); operations on other capsules, and
everything else the store does, go on.

A claim is ``flock`` on ``busy/<capsule>`` in the store, so it holds across threads and processes (the agent
and the command line alike) and ends with its holder whatever happens to it; the file says what is being
done and since when, and names the leaves the operation made that no instance records yet (gc keeps them,
:func:`leaves_in_flight`). Its last holder removes the file. Claims are re-entrant per thread: ``snapshot``
claims its capsule, then its ``suspend`` and ``start`` claim it again.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsule.errors import CapsuleBusy, Internal
from capsule.names import check_name
from capsule.store.fsutil import make_private_dir
from capsule.store.locks import lock_for
from capsule.store.store import Store

BUSY_DIR = "busy"
SETTLE = 0.5        # seconds a claim file held but not yet described is given to say who holds it
GLANCE = 0.1        # seconds any contention is tried again first (gc and ``holder`` look with a shared lock)


@dataclass
class Claim:
    """A held claim on one capsule (see the module's text)."""

    path: Path
    fd: int
    doing: str
    depth: int = 1
    leaves: list[str] = field(default_factory=list)

    def add_leaves(self, leaves: list[Path]) -> None:
        """Name leaves this operation made before any instance records them: gc leaves them alone."""
        self.leaves.extend(str(p) for p in leaves)
        _describe(self)


_local = threading.local()


def _held() -> dict[tuple[str, str], Claim]:
    held: dict[tuple[str, str], Claim] | None = getattr(_local, "held", None)
    if held is None:
        held = _local.held = {}
    return held


def busy_dir(store: Store) -> Path:
    return store.home / BUSY_DIR


@contextmanager
def claim(store: Store, name: str, doing: str) -> Iterator[Claim]:
    """Hold the claim on capsule ``name`` for the ``with`` block, ``doing`` saying what for ("stopping").
    Raises :class:`CapsuleBusy` at once when another operation holds it; a thread holding it already
    takes it again."""
    key = (os.path.realpath(store.home), check_name(name))
    held = _held()
    mine = held.get(key)
    if mine is not None:
        mine.depth += 1
        try:
            yield mine
        finally:
            mine.depth -= 1
        return
    mine = _acquire(busy_dir(store) / name, name, doing)
    held[key] = mine
    try:
        yield mine
    finally:
        del held[key]
        _release(mine)


def holder(store: Store, name: str) -> dict[str, Any] | None:
    """What holds the claim on ``name`` (its record: doing, pid, host, since), or None when nothing does."""
    path = busy_dir(store) / check_name(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return _read(fd) if _is_held(fd) else None
    finally:
        os.close(fd)


def leaves_in_flight(store: Store) -> set[str]:
    """Leaves named by held claims: made by an operation under way, not recorded by any instance yet."""
    out: set[str] = set()
    d = busy_dir(store)
    if not d.is_dir():
        return out
    for path in d.iterdir():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            if _is_held(fd):
                record = _read(fd) or {}
                out.update(str(x) for x in record.get("leaves", []) if isinstance(x, str))
        finally:
            os.close(fd)
    return out


def check_unlocked(store: Store, what: str) -> None:
    """Refuse to wait on a guest while this thread holds the store lock (a caller that took it around a
    lifecycle call would make every other tenant wait with it)."""
    if lock_for(store.home).held_by_me():
        raise Internal(f"{what} would wait on a guest while holding the store lock; call it without the lock")


def _acquire(path: Path, name: str, doing: str) -> Claim:
    make_private_dir(path.parent)      # made on the store's first claim
    settle = time.monotonic() + SETTLE
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read(fd)
            os.close(fd)
            waited = time.monotonic() - (settle - SETTLE)
            # someone only looking (a moment), or a holder that has not said who it is yet
            if waited < GLANCE or (record is None and waited < SETTLE):
                time.sleep(0.02)
                continue
            raise _busy(name, record) from None
        except BaseException:
            os.close(fd)
            raise
        if not _same_file(fd, path):    # its last holder removed it between our open and our lock
            os.close(fd)
            continue
        mine = Claim(path, fd, doing)
        _describe(mine)
        return mine


def _release(mine: Claim) -> None:
    try:
        if _same_file(mine.fd, mine.path):
            mine.path.unlink(missing_ok=True)     # still locked: whoever opened it meanwhile tries again
    finally:
        with suppress(OSError):
            fcntl.flock(mine.fd, fcntl.LOCK_UN)
        os.close(mine.fd)


def _describe(mine: Claim) -> None:
    t = threading.current_thread()
    record = {"doing": mine.doing, "pid": os.getpid(), "host": socket.gethostname(), "thread": t.name,
              "since": time.time(), "leaves": mine.leaves}
    with suppress(OSError):       # a full disk must not stop a stop: the record only helps the message
        os.ftruncate(mine.fd, 0)
        os.pwrite(mine.fd, json.dumps(record).encode(), 0)


def _read(fd: int) -> dict[str, Any] | None:
    try:
        text = os.pread(fd, 1 << 16, 0).decode(errors="replace")
        record = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _is_held(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _busy(name: str, record: dict[str, Any] | None) -> CapsuleBusy:
    doing = str(record.get("doing") or "busy") if record else "busy with another operation"
    since = record.get("since") if record else None
    when = f" since {time.strftime('%H:%M:%S', time.localtime(since))}" if isinstance(since, (int, float)) else ""
    return CapsuleBusy(f"capsule {name!r} is {doing}{when}; try again when that is done", doing=doing)
