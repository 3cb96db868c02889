"""The batch pipeline stops at the first failure: queued batches are never sent, the error is raised."""

from __future__ import annotations

import threading
import time

import pytest

from capsule.pipeline import Pipeline, run_batches

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Boom(Exception):
    pass


def _work(fail_at: int, ran: list[int], lock: threading.Lock):
    def work(batch: int) -> None:
        with lock:
            ran.append(batch)
        time.sleep(0.01)
        if batch == fail_at:
            raise Boom(f"batch {batch} failed")
    return work


@pytest.mark.parametrize("max_pending", [None, 8])
def test_a_failure_stops_the_queued_batches_and_is_raised(max_pending):
    ran: list[int] = []
    work = _work(3, ran, threading.Lock())
    with pytest.raises(Boom, match="batch 3 failed"), Pipeline(work, 4, max_pending) as pipe:
        for b in range(50):
            pipe.submit(b)
    assert 3 in ran
    assert len(ran) <= 4 + 4 + 1, ran  # what was running when batch 3 failed, not the 46 after it


def test_run_batches_raises_the_first_error_and_sends_few():
    ran: list[int] = []
    with pytest.raises(Boom):
        run_batches(range(50), 4, _work(3, ran, threading.Lock()))
    assert len(ran) <= 9, ran


def test_every_batch_runs_when_none_fails_and_inflight_is_respected():
    running = 0
    peak = 0
    lock = threading.Lock()
    done: list[int] = []

    def work(b: int) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.005)
        with lock:
            running -= 1
            done.append(b)

    run_batches(range(40), 3, work)
    assert sorted(done) == list(range(40))
    assert 1 <= peak <= 3


def test_an_error_in_the_caller_stops_the_batches_too():
    ran: list[int] = []
    lock = threading.Lock()
    with pytest.raises(KeyError), Pipeline(_work(-1, ran, lock), 2) as pipe:
        for b in range(30):
            pipe.submit(b)
        raise KeyError("the next manifest part failed")
    assert len(ran) < 30
