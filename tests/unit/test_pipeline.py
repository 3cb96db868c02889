"""The batch pipeline stops at the first failure: queued batches are never sent, the error is raised."""

from __future__ import annotations

import threading
import time

import pytest

from capsule.transfer.pipeline import Pipeline, run_batches

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Boom(Exception):
    pass


def _work(fail_at: int, ran: list[int], lock: threading.Lock, at_failure: list[int] | None = None):
    """Each batch sleeps 10 ms; ``fail_at`` then fails, noting in ``at_failure`` how many had started."""
    def work(batch: int) -> None:
        with lock:
            ran.append(batch)
        time.sleep(0.01)
        if batch == fail_at:
            with lock:
                if at_failure is not None:
                    at_failure.append(len(ran))
            raise Boom(f"batch {batch} failed")
    return work


@pytest.mark.parametrize("max_pending", [None, 8])
def test_a_failure_stops_the_queued_batches_and_is_raised(max_pending):
    ran: list[int] = []
    at_failure: list[int] = []
    work = _work(3, ran, threading.Lock(), at_failure)
    with pytest.raises(Boom, match="batch 3 failed"), Pipeline(work, 4, max_pending) as pipe:
        for b in range(50):
            pipe.submit(b)
    assert 3 in ran
    # after batch 3 failed, at most the 3 other workers, already past their check, start one batch each:
    # counted from the failure, so a slow machine's later first batches do not matter; not the 46 after it
    assert len(ran) <= at_failure[0] + 3 < 50, (ran, at_failure)


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


class _FailBegin:
    """A transport wrapper: the manifest part ``part`` is refused (500); counts block uploads."""

    def __init__(self, inner, part: int) -> None:
        self.inner, self.url, self.part = inner, inner.url, part
        self.block_uploads = 0
        self.lock = threading.Lock()

    def call(self, call):
        from hashcache.transport import Reply

        if call.path.endswith("/begin") and str((call.params or {}).get("part")) == str(self.part):
            return Reply(500, b'{"error": "internal", "detail": "the receiver fell over"}')
        if call.path.endswith("/blocks"):
            with self.lock:
                self.block_uploads += 1
        return self.inner.call(call)

    def close(self):
        self.inner.close()


def test_a_push_that_fails_does_not_send_the_queued_batches(tmp_path, monkeypatch):
    """Old code: the part loop's ThreadPoolExecutor waited for every queued batch when a later manifest
    part failed, so all of them were still sent."""
    from capsule import transfer
    from capsule.agentclient import AgentClient
    from capsule.errors import Internal
    from capsule.store import Store
    from capsule.transfer import pushing
    from hashcache.transport.memory import in_process
    from tests.helpers.transport_fixtures import TOKEN, agent_app

    monkeypatch.setattr(pushing, "PART_RECORDS", 128)  # a small object in several manifest parts
    src = Store.open(tmp_path / "src")
    path = src.temp_path("-obj")
    path.write_bytes(b"".join((i + 1).to_bytes(4, "little") * 1024 for i in range(300)))
    row = src.seal_file(path, "kernel")
    with src.catalogue.transaction():
        src.catalogue.add_file(row)
    with agent_app(tmp_path / "dst") as dst:
        wrapper = _FailBegin(in_process(dst.app, TOKEN, stream=False), part=1)
        client = AgentClient("http://dst.example", TOKEN, transport=wrapper)
        opts = transfer.Options(batch=1, inflight=4)
        with pytest.raises(Internal, match="the receiver fell over"):
            pushing._push_object(src, client, "file", row.id, "kernel", opts, transfer.Progress())
        client.close()
    assert wrapper.block_uploads < 40, wrapper.block_uploads  # part 0 asked for 128 blocks, one per batch
    src.close()
