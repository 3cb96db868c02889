"""A pull over a slow link keeps only a few seconds' worth of READ answers in flight (capsule/transfer/pacing.py),
as a push does with its uploads: with a fixed 8 × 256 blocks in flight, answers queue on the link for
minutes at 384 kbit/s, and over TLS such answers were cut off before they arrived."""

from __future__ import annotations

import threading

import pytest

from capsule import capsules, transfer
from capsule.agent.app import create_app
from capsule.store import Store
from capsule.transfer.pacing import MIN_BATCH, TARGET_S
from hashcache.hcp import decode_indices
from hashcache.transport import Call, Reply
from hashcache.transport.memory import in_process
from hashcache.transport.wrappers import RateLimited
from testkit.fleetkit import new_version
from testkit.images import make_store

pytestmark = [pytest.mark.tools, pytest.mark.timeout(180)]

TOKEN = "pull-pacing-token-0123456789abcdef"
RATE = 400_000          # bytes per second on the "link"
MiB = 1 << 20
SETTLED = 16


class InFlight:
    """Counts the blocks asked for by READ calls not yet answered, and the most at once."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.url = inner, inner.url
        self.now = self.most = 0        # most: once SETTLED requests went out (the first rates are rough)
        self.batches: list[int] = []
        self._lock = threading.Lock()

    def call(self, call: Call) -> Reply:
        n = len(decode_indices(call.content, 1 << 30)) if call.path.endswith("/read") else 0
        with self._lock:
            self.now += n
            if n:
                self.batches.append(n)
            if len(self.batches) > SETTLED:
                self.most = max(self.most, self.now)
        try:
            return self.inner.call(call)
        finally:
            with self._lock:
                self.now -= n

    def close(self) -> None:
        self.inner.close()


def test_a_pull_over_a_slow_link_keeps_a_few_seconds_of_answers_in_flight(tmp_path, tiny_images):
    b = make_store(tmp_path / "b", tiny_images, "tiny")
    capsules.create(b, "cap", "tiny", memory="256M")
    version = new_version(b, "cap", 4 * MiB, seed=4)            # random: every block travels, ~4 KiB each
    b.close()
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    link = RateLimited(in_process(create_app(tmp_path / "b", TOKEN), TOKEN, stream=False), RATE, burst=4096)
    recorder = InFlight(link)
    r = transfer.pull(a, recorder.url, version.ref, TOKEN, transport=recorder)
    assert Store.open(tmp_path / "a").catalogue.version("cap", version.number) is not None
    assert r.totals()["fetched_bytes"] >= 4 * MiB
    window_blocks = TARGET_S * RATE / 4096
    # unpaced: 8 × 256 = 2048 blocks (8 MiB, 21 s of this link) asked for at once from the start
    assert recorder.most <= 1.5 * window_blocks + 256, (recorder.most, window_blocks, recorder.batches)
    assert len(recorder.batches) > SETTLED + 4, recorder.batches   # unpaced: 4 batches of 256 blocks
    later = sorted(recorder.batches[SETTLED:])
    assert MIN_BATCH < later[len(later) // 2] < 256, recorder.batches   # batches follow the window, not the limit

    # on a fast link (no limit here) the window opens after the first answers: large batches, few requests
    # (batches sized before any answer came back would all be MIN_BATCH: 64 requests for 4 MiB)
    fast = InFlight(in_process(create_app(tmp_path / "b", TOKEN), TOKEN, stream=False))
    c = make_store(tmp_path / "c", tiny_images, "tiny")
    transfer.pull(c, fast.url, version.ref, TOKEN, transport=fast)
    assert max(fast.batches) >= 128 and len(fast.batches) <= 24, ("fast", fast.batches)
