"""A push's background uploads (capsule/repo/uploads.py), against a stand-in bucket whose PUTs the test holds
and releases: every PUT is done when ``wait`` returns, at most ``workers + depth`` are unfinished at once,
the first failure is raised, and leaving early abandons what had not started."""

from __future__ import annotations

import threading
import time

import pytest

from capsule.errors import Unreachable
from capsule.repo.uploads import Uploads

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class HeldBucket:
    """PUTs that each wait for ``release`` (all of them once ``open`` is set)."""

    def __init__(self, fail: set[str] = frozenset()) -> None:   # type: ignore[assignment]
        self.stored: dict[str, bytes] = {}
        self.started: list[str] = []
        self.fail = fail
        self.open = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most_running = 0

    def put(self, key: str, data: bytes) -> None:
        with self.lock:
            self.started.append(key)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            assert self.open.wait(10), "the test never released the PUTs"
            if key in self.fail:
                raise Unreachable(f"PUT {key}: the object store cannot be reached")
            with self.lock:
                self.stored[key] = data
        finally:
            with self.lock:
                self.running -= 1


def test_wait_returns_once_every_put_is_stored() -> None:
    bucket = HeldBucket()
    bucket.open.set()
    with Uploads(bucket) as up:   # type: ignore[arg-type]
        for i in range(9):
            up.put(f"packs/{i}", bytes([i]) * 10)
        up.wait()
        assert bucket.stored == {f"packs/{i}": bytes([i]) * 10 for i in range(9)}
    assert bucket.most_running <= 2


def test_put_blocks_while_workers_and_depth_are_unfinished() -> None:
    bucket = HeldBucket()
    up = Uploads(bucket, workers=2, depth=1)   # type: ignore[arg-type]
    try:
        for i in range(3):                     # two in flight, one waiting: none blocks
            up.put(f"packs/{i}", b"x")
        fourth = threading.Thread(target=up.put, args=("packs/3", b"x"))
        fourth.start()
        fourth.join(0.5)
        assert fourth.is_alive(), "a fourth pack was taken while three were unfinished"
        assert len(bucket.started) == 2
        bucket.open.set()
        fourth.join(10)
        assert not fourth.is_alive()
        up.wait()
        assert sorted(bucket.stored) == [f"packs/{i}" for i in range(4)]
    finally:
        bucket.open.set()
        up.close()


def test_the_first_failure_is_raised_by_wait() -> None:
    bucket = HeldBucket(fail={"packs/1"})
    bucket.open.set()
    with Uploads(bucket) as up, pytest.raises(Unreachable, match="packs/1"):   # type: ignore[arg-type]
        for i in range(3):
            up.put(f"packs/{i}", b"x")
        up.wait()


def test_a_failure_is_raised_by_a_later_put() -> None:
    bucket = HeldBucket(fail={"packs/0"})
    bucket.open.set()
    with Uploads(bucket, workers=1, depth=0) as up:   # type: ignore[arg-type]
        up.put("packs/0", b"x")
        with pytest.raises(Unreachable, match="packs/0"):
            up.put("packs/1", b"x")                   # waits for the first, which failed
    assert "packs/1" not in bucket.started


def test_leaving_early_abandons_the_puts_not_started() -> None:
    bucket = HeldBucket()
    up = Uploads(bucket, workers=1, depth=3)   # type: ignore[arg-type]
    for i in range(4):
        up.put(f"packs/{i}", b"x")
    closing = threading.Thread(target=up.close)
    closing.start()
    deadline = time.monotonic() + 10
    while up._pending and time.monotonic() < deadline:   # close has cancelled the waiting ones
        time.sleep(0.01)
    bucket.open.set()                          # the one in flight finishes; the waiting ones never start
    closing.join(10)
    assert not closing.is_alive()
    assert bucket.started == ["packs/0"]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Uploads(HeldBucket(), workers=0)   # type: ignore[arg-type]
