"""The store lock excludes threads of one process and other processes, is re-entrant per
thread, and names its holder when a wait times out (against real processes: tests/tools/test_store_lock.py)."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from capsule.store import Store
from capsule.store.locks import LockTimeout, lock_for
from tests.helpers.locks import lock_held


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "store")
    yield s
    s.close()


def _bump(counter: Path) -> None:
    value = int(counter.read_text() or "0")
    time.sleep(0.001)                       # widen the window a lost update needs
    counter.write_text(str(value + 1))


def _other_process_could_lock(store: Store) -> bool:
    """Would another process (gc, rm) get the file lock now? A second open file description
    behaves towards flock exactly like another process."""
    fd = os.open(store.home / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_threads_sharing_one_store_hold_it_one_at_a_time(store, tmp_path):
    counter = tmp_path / "counter"
    counter.write_text("0")
    inside = [0]
    overlaps = []
    depths = []
    guard = threading.Lock()

    def worker() -> None:
        for _ in range(20):
            with store.lock():
                with guard:
                    inside[0] += 1
                    overlaps.append(inside[0])
                with store.lock():          # re-entry by the same thread
                    depths.append(lock_for(store.home).depth)
                _bump(counter)
                with guard:
                    inside[0] -= 1
            depths.append(lock_for(store.home).depth)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert int(counter.read_text()) == 6 * 20
    assert max(overlaps) == 1
    assert set(depths) == {2, 0}            # never negative, nothing left held


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_other_processes_stay_excluded_while_any_thread_holds_the_lock(store):
    a_in, b_in, a_go, b_go = (threading.Event() for _ in range(4))

    def a() -> None:
        with store.lock():
            a_in.set()
            a_go.wait(10)

    def b() -> None:
        with store.lock():
            b_in.set()
            b_go.wait(10)

    ta = threading.Thread(target=a)
    ta.start()
    assert a_in.wait(10)
    tb = threading.Thread(target=b)
    tb.start()
    assert not b_in.wait(0.3)               # B waits while A holds the store
    assert not _other_process_could_lock(store)
    a_go.set()
    ta.join(10)
    assert b_in.wait(10)
    assert not _other_process_could_lock(store)   # A left, B holds it: still excluded
    b_go.set()
    tb.join(10)
    assert _other_process_could_lock(store)
    with store.lock():                      # and the next holder takes the file lock again
        assert not _other_process_could_lock(store)
    assert lock_for(store.home).depth == 0


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_second_store_object_in_the_same_thread_re_enters(store):
    other = Store.open(store.home)
    try:
        with store.lock(), other.lock(timeout=1):
            assert lock_for(store.home).depth == 2
    finally:
        other.close()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_wait_that_times_out_names_the_holder(store):
    held, go = threading.Event(), threading.Event()

    def holder() -> None:
        with store.lock(purpose="gc"):
            held.set()
            go.wait(10)

    t = threading.Thread(target=holder, name="gc-thread")
    t.start()
    try:
        assert held.wait(10)
        record = store.lock_holder()
        assert record is not None and record["pid"] == os.getpid() and record["thread"] == "gc-thread"
        with pytest.raises(LockTimeout, match=rf"pid {os.getpid()} on .*thread gc-thread, gc"), store.lock(timeout=0.2):
            pass
    finally:
        go.set()
        t.join(10)
    assert store.lock_holder() is None


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_wait_for_another_process_times_out_too(store, monkeypatch):
    fd = os.open(store.home / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b'{"host": "elsewhere", "pid": 4242, "thread": "MainThread", "purpose": "rm", "since": 0}')
        monkeypatch.setenv("CAPSULE_LOCK_TIMEOUT", "0.2")
        t0 = time.monotonic()
        with pytest.raises(LockTimeout, match="pid 4242 on elsewhere"), store.lock():
            pass
        assert time.monotonic() - t0 < 5
        assert store.lock_holder()["pid"] == 4242
    finally:
        os.close(fd)                        # the holder dies: its record stays in the file …
    assert "4242" in (store.home / ".lock").read_text()
    assert store.lock_holder() is None      # … but is known to be stale
    with store.lock(timeout=1):             # the kernel dropped the lock with its holder's descriptor
        assert store.lock_holder()["pid"] == os.getpid()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_opening_a_store_does_not_wait_for_its_lock(store, monkeypatch):
    with lock_held(store, "a long suspend"):
        monkeypatch.setenv("CAPSULE_LOCK_TIMEOUT", "0.2")
        other = Store.open(store.home)          # `capsule ls` while the agent suspends
        assert other.id == store.id
        other.close()
