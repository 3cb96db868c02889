"""Ballooning before suspend (§4.1) with the in-guest agent, on real guests."""

from __future__ import annotations

import time

import pytest

from capsule import capsules, lifecycle
from capsule.runtime.guestagent import wait_for_agent
from tests.helpers.guest import run

pytestmark = pytest.mark.vm

DIRTY_AND_FREE = "python3 -c \"b = bytearray(b'Z') * (200 << 20); del b\""
ALLOCATE_300 = "python3 -c \"b = bytearray(300 << 20); b[::4096] = b'\\x01' * (len(b) // 4096); print('ok')\""


def _agent_sock(store, name):
    return store.instance_dir(name) / "agent.sock"


def test_silent_agent_does_not_block_suspend(store):
    capsules.create(store, "quiet", "tiny", memory="256M")
    lifecycle.start(store, "quiet")
    wait_for_agent(_agent_sock(store, "quiet"), timeout=60)
    run(store, "quiet", "kill -STOP $(pidof capsule-agent)")  # alive but never answers
    t = time.monotonic()
    sealed = lifecycle.suspend(store, "quiet", balloon="cache")
    assert sealed.version is not None and sealed.balloon is not None
    assert sealed.balloon.skipped and "did not answer" in sealed.balloon.skipped
    assert time.monotonic() - t < 30
    assert "balloon" not in sealed.version.config
    lifecycle.start(store, "quiet")
    run(store, "quiet", "kill -CONT $(pidof capsule-agent)")


def test_tiny_balloon_shrinks_the_memory_image(store):
    capsules.create(store, "tb", "tiny", memory="256M")
    lifecycle.start(store, "tb")
    wait_for_agent(_agent_sock(store, "tb"), timeout=60)
    # fill 100 MiB of tmpfs with non-zero data, then free it: the pages keep their contents
    run(store, "tb", "dd if=/dev/zero bs=1M count=100 2>/dev/null | tr '\\000' 'Z' > /tmp/fill; rm /tmp/fill")
    plain = lifecycle.suspend(store, "tb")
    lifecycle.start(store, "tb")
    run(store, "tb", "dd if=/dev/zero bs=1M count=100 2>/dev/null | tr '\\000' 'Z' > /tmp/fill; rm /tmp/fill")
    ballooned = lifecycle.suspend(store, "tb", balloon="cache", balloon_method="agent")
    assert ballooned.balloon is not None and not ballooned.balloon.skipped
    assert ballooned.balloon.held_bytes > 100 << 20
    saved = plain.memory.stored_bytes - ballooned.memory.stored_bytes
    assert saved > 60 << 20, (plain.memory.stored_bytes, ballooned.memory.stored_bytes)
    # after the restore the guest has its memory back without anyone asking
    lifecycle.start(store, "tb")
    with_agent = wait_for_agent(_agent_sock(store, "tb"), timeout=30)
    assert with_agent
    from capsule.runtime.guestagent import GuestAgent

    with GuestAgent(_agent_sock(store, "tb")) as agent:
        assert agent.status()["held_bytes"] == 0


def test_virtio_balloon_shrinks_and_gives_back(store):
    capsules.create(store, "tv", "tiny", memory="256M")
    lifecycle.start(store, "tv")
    wait_for_agent(_agent_sock(store, "tv"), timeout=60)
    run(store, "tv", "dd if=/dev/zero bs=1M count=100 2>/dev/null | tr '\\000' 'Z' > /tmp/fill; rm /tmp/fill")
    sealed = lifecycle.suspend(store, "tv", balloon="cache", balloon_method="virtio")
    assert sealed.balloon is not None and not sealed.balloon.skipped, sealed.balloon
    assert sealed.balloon.held_bytes > 100 << 20
    assert sealed.memory.stored_bytes < 100 << 20
    lifecycle.start(store, "tv")
    from capsule.runtime.connection import lookup_domain

    dom = lookup_domain(store.domain_name("tv"))
    # the balloon is deflated again (to within the driver's rounding)
    deadline = time.monotonic() + 20
    while dom.maxMemory() - dom.info()[2] > 8 << 10 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert dom.maxMemory() - dom.info()[2] <= 8 << 10
    total_kib = int(run(store, "tv", "grep MemTotal /proc/meminfo").split()[1])
    assert total_kib > 200 * 1024


@pytest.mark.slow
def test_debian_balloon_frees_dirty_memory_and_gives_it_back(debian_store):
    store = debian_store
    capsules.create(store, "deb", "debian", memory="512M")
    lifecycle.start(store, "deb", timeout=300)
    wait_for_agent(_agent_sock(store, "deb"), timeout=120)
    run(store, "deb", DIRTY_AND_FREE, timeout=120)
    plain = lifecycle.suspend(store, "deb")
    lifecycle.start(store, "deb")
    run(store, "deb", DIRTY_AND_FREE, timeout=120)
    ballooned = lifecycle.suspend(store, "deb", balloon="cache")
    assert ballooned.balloon is not None and not ballooned.balloon.skipped
    saved = plain.memory.stored_bytes - ballooned.memory.stored_bytes
    # most of the 200 MB that were dirtied and freed are no longer in the image
    assert saved > 120 << 20, (plain.memory.stored_bytes, ballooned.memory.stored_bytes)
    lifecycle.start(store, "deb")
    total_kib = int(run(store, "deb", "grep MemTotal /proc/meminfo").split()[1])
    assert total_kib > 400 * 1024
    assert run(store, "deb", ALLOCATE_300, timeout=120) == "ok"
