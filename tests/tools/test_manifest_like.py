"""A memory image's manifest travels against an older memory image of the same capsule that the receiver
holds (capsule/transfer/manifestparts.py, hashcache.hcp.like_records): the parts come to a fraction of their
plain size, the object arrives whole and checked, and a like the receiver lacks or may not read leaves the
parts plain."""

from __future__ import annotations

import dataclasses
import os

import pytest

from capsule import capsules, transfer
from capsule.transfer import Options
from capsule.verify import verify
from testkit.images import make_store
from tests.conftest import Agent

pytestmark = [pytest.mark.tools, pytest.mark.timeout(300)]

BLOCKS = 12_000     # a memory image of 47 MiB: each block its own (its index), and compressible


def _memory(store, tmp_path, name: str, changed: set[int], seed: bytes) -> str:
    """A sealed memory image: block i holds i (and ``seed`` where ``changed``), the rest zeros."""
    f = tmp_path / name
    with f.open("wb") as out:
        for i in range(BLOCKS):
            out.write((i.to_bytes(8, "little") + (seed if i in changed else b"")).ljust(4096, b"\1"))
    row = store.seal_file(f, "memory")
    store.catalogue.add_file(row)
    return row.id


def _version(store, number: int, memory: str) -> str:
    latest = store.catalogue.latest_version("cap")
    store.catalogue.add_version(dataclasses.replace(latest, number=number, memory=memory, note="test"))
    return f"cap@{number}"


@pytest.fixture
def stores(tmp_path, tiny_images):
    """A with a capsule; B and C empty, each with an agent."""
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    capsules.create(a, "cap", "tiny", memory="256M")
    receivers = [(make_store(tmp_path / n, tiny_images), Agent(tmp_path / n, tmp_path / f"{n}.token"))
                 for n in ("b", "c")]
    yield a, receivers
    for _store, agent in receivers:
        agent.stop()


def test_the_manifest_travels_against_yesterdays_memory_image(stores, tmp_path):
    a, [(b, agent_b), (_c, agent_c)] = stores
    yesterday = _version(a, 10, _memory(a, tmp_path, "y.mem", set(), b""))
    today_mem = _memory(a, tmp_path, "t.mem", set(range(0, BLOCKS, 500)), os.urandom(16))   # 24 blocks changed
    today = _version(a, 11, today_mem)
    for agent in (agent_b, agent_c):
        assert transfer.push(a, yesterday, agent.url, agent.token).recorded

    plain = transfer.push(a, today, agent_c.url, agent_c.token, Options(like=False))
    liked = transfer.push(a, today, agent_b.url, agent_b.token)
    [mem] = [o for o in plain.objects if o.role == "memory"]
    [mem2] = [o for o in liked.objects if o.role == "memory"]
    assert mem.like is None and mem2.like == a.catalogue.version("cap", 10).memory
    assert liked.recorded and verify(b).ok
    assert b.file_manifest(today_mem).digest == today_mem
    # the 24 changed blocks travel either way; the records of the 11,976 others cost next to nothing
    print(f"\nmemory image of {BLOCKS} blocks: {mem.wire_bytes} bytes with a plain manifest, "
          f"{mem2.wire_bytes} against yesterday's")
    assert mem2.wire_bytes < mem.wire_bytes - BLOCKS * 8


def test_a_like_the_receiver_lacks_leaves_the_parts_plain(stores, tmp_path):
    a, [(b, agent), _c] = stores
    _version(a, 10, _memory(a, tmp_path, "y.mem", set(), b""))    # never pushed: b does not hold it
    today = _version(a, 11, _memory(a, tmp_path, "t.mem", {3}, b"x"))
    r = transfer.push(a, today, agent.url, agent.token)
    assert r.recorded and verify(b).ok
    assert [o.like for o in r.objects if o.role == "memory"] == [None]


def test_a_pull_reads_the_records_against_the_memory_image_it_holds(stores, tmp_path):
    a, [(b, agent_b), (c, agent_c)] = stores
    yesterday = _version(a, 10, _memory(a, tmp_path, "y.mem", set(), b""))
    today_mem = _memory(a, tmp_path, "t.mem", set(range(0, BLOCKS, 500)), os.urandom(16))
    _version(a, 11, today_mem)
    for agent in (agent_b, agent_c):
        assert transfer.push(a, yesterday, agent.url, agent.token).recorded
    agent_a = Agent(a.home, tmp_path / "a.token")
    try:
        liked = transfer.pull(b, agent_a.url, "cap@11", agent_a.token)
        plain = transfer.pull(c, agent_a.url, "cap@11", agent_a.token, Options(like=False))
    finally:
        agent_a.stop()
    [mem] = [o for o in liked.objects if o.role == "memory"]
    [mem_plain] = [o for o in plain.objects if o.role == "memory"]
    assert liked.recorded and verify(b).ok and b.file_manifest(today_mem).digest == today_mem
    print(f"\npulled memory image of {BLOCKS} blocks: {mem_plain.wire_bytes} bytes with plain records, "
          f"{mem.wire_bytes} against yesterday's")
    assert mem.wire_bytes < mem_plain.wire_bytes - BLOCKS * 8
