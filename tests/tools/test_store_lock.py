"""The store lock against real processes: threads of this process and other processes contend for one
store and no update is lost (the in-process checks are in tests/unit/test_store_lock.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from capsule.store import Store
from capsule.store.locks import lock_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "store")
    yield s
    s.close()


def _bump(counter: Path) -> None:
    value = int(counter.read_text() or "0")
    time.sleep(0.001)                       # widen the window a lost update needs
    counter.write_text(str(value + 1))


WORKER = """
import sys, time
from pathlib import Path
from capsule.store import Store
store = Store.open(Path(sys.argv[1]))
counter = Path(sys.argv[2])
for _ in range(int(sys.argv[3])):
    with store.lock():
        value = int(counter.read_text() or "0")
        time.sleep(0.001)
        counter.write_text(str(value + 1))
"""


@pytest.mark.tools
@pytest.mark.timeout(120)
def test_threads_and_processes_contend_and_no_update_is_lost(store, tmp_path):
    counter = tmp_path / "counter"
    counter.write_text("0")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(store.home), str(counter), "40"], env=env)
             for _ in range(2)]

    def worker() -> None:
        for _ in range(30):
            with store.lock():
                _bump(counter)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for p in procs:
        assert p.wait(60) == 0
    assert int(counter.read_text()) == 2 * 40 + 4 * 30
    assert lock_for(store.home).depth == 0
