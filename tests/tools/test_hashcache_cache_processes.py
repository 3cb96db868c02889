"""hashcache.cache with real processes: several processes sharing one cache, a writer killed
mid-flight, and qcow2 layers made by qemu-img."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hashcache import HashCache
from hashcache.blocks import hash_block, hash_blocks
from hashcache.manifest import manifest_of_layer
from tests.unit.test_hashcache_cache import B, content, needs_qemu, one_bucket_size

pytestmark = pytest.mark.tools


@pytest.fixture
def cache(tmp_path: Path):
    c = HashCache.open(tmp_path / "host.hcache", size_bytes=1 << 20, readahead=0)
    yield c
    c.close()


@needs_qemu
def test_insert_file_from_layer_manifest_uses_host_offsets(cache: HashCache, tmp_path: Path) -> None:
    raw = tmp_path / "disk.raw"
    guest = [content(i, b"guest") if i % 3 else bytes(B) for i in range(64)]
    raw.write_bytes(b"".join(guest))
    layer = tmp_path / "disk.qcow2"
    subprocess.run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=65536", str(raw), str(layer)],
        check=True,
        capture_output=True,
    )
    m = manifest_of_layer(layer, None)
    assert cache.insert_file(layer, m) == sum(1 for b in guest if b != bytes(B))
    for i, b in enumerate(guest):
        if b != bytes(B):
            assert cache.lookup(hash_block(b)) == b
            (entry,) = cache.peek(hash_block(b))
            assert entry.path == str(layer) and entry.offset != i * B  # a host offset


UNIVERSE = 512


SLOTS = 64


def _universe() -> tuple[list[bytes], list[bytes]]:
    blocks = [content(i, b"universe") for i in range(UNIVERSE)]
    return blocks, [hash_block(b) for b in blocks]


def _hammer(cache_path: str, files: list[str], seed: int, seconds: float) -> tuple[int, int, int]:
    """Insert (good and bogus entries), rewrite file blocks and look up, all at random.

    Returns (hits, wrong, lookups); ``wrong`` counts returned blocks that are not the data hashed.
    """
    blocks, hashes = _universe()
    rng = random.Random(seed)
    hits = wrong = lookups = 0
    with HashCache.open(cache_path, readahead=rng.choice((0, 8))) as c:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            op = rng.random()
            if op < 0.25:  # rewrite a block in place under everyone's feet, and say where it is now
                i, f, slot = rng.randrange(UNIVERSE), rng.choice(files), rng.randrange(SLOTS)
                fd = os.open(f, os.O_WRONLY)
                try:
                    os.pwrite(fd, blocks[i], slot * B)
                finally:
                    os.close(fd)
                c.insert(hashes[i], f, slot * B)
            elif op < 0.35:  # a bogus entry: right hash, wrong place (or unaligned)
                c.insert(hashes[rng.randrange(UNIVERSE)], rng.choice(files), rng.randrange(SLOTS * B))
            else:
                batch = [rng.randrange(UNIVERSE) for _ in range(8)]
                for i, got in zip(batch, c.lookup_many([hashes[i] for i in batch]), strict=True):
                    lookups += 1
                    if got is not None:
                        hits += 1
                        wrong += got != blocks[i]
    return hits, wrong, lookups


def _make_files(tmp_path: Path) -> list[str]:
    blocks, _ = _universe()
    rng = random.Random(0)
    files = []
    for k in range(4):
        p = tmp_path / f"f{k}"
        p.write_bytes(b"".join(blocks[rng.randrange(UNIVERSE)] for _ in range(SLOTS)))
        files.append(str(p))
    return files


def test_processes_share_the_cache_and_never_get_wrong_data(tmp_path: Path) -> None:
    files = _make_files(tmp_path)
    cpath = str(tmp_path / "shared.hc")
    # One bucket (128 slots) for 512 blocks plus bogus entries: every writer races on the same page.
    HashCache.open(cpath, size_bytes=one_bucket_size(1)).close()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        results = pool.starmap(_hammer, [(cpath, files, seed, 2.0) for seed in (1, 2, 3)])
    assert sum(r[1] for r in results) == 0, results
    assert all(r[0] > 0 for r in results), results
    with HashCache.open(cpath, create=False) as c:
        s = c.stats()
        assert s["hits"] == sum(r[0] for r in results)
        assert s["hits"] + s["misses"] == sum(r[2] for r in results)
        assert s["evictions"] > 0 and s["invalidations"] > 0, s
        blocks, hashes = _universe()
        for i, got in enumerate(c.lookup_many(hashes)):
            assert got is None or got == blocks[i]


def _insert_forever(cache_path: str, files: list[str], ready: object) -> None:
    """Insert true entries (what the files hold) and bogus ones, and look up, until killed."""
    _, hashes = _universe()
    truth = [(h, f, i * B) for f in files for i, h in enumerate(hash_blocks(Path(f).read_bytes()))]
    rng = random.Random(7)
    with HashCache.open(cache_path) as c:
        ready.set()  # type: ignore[attr-defined]
        while True:
            good = [truth[rng.randrange(len(truth))] for _ in range(48)]
            bogus = [(hashes[rng.randrange(UNIVERSE)], rng.choice(files), rng.randrange(SLOTS) * B) for _ in range(16)]
            c.insert_many(good + bogus)
            c.lookup(hashes[rng.randrange(UNIVERSE)])


def test_writer_killed_mid_flight_costs_only_misses(tmp_path: Path) -> None:
    files = _make_files(tmp_path)
    cpath = str(tmp_path / "crash.hc")
    HashCache.open(cpath, size_bytes=one_bucket_size(2)).close()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_insert_forever, args=(cpath, files, ready))
    proc.start()
    try:
        assert ready.wait(30)
        time.sleep(0.4)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    assert proc.exitcode == -signal.SIGKILL
    blocks, hashes = _universe()
    with HashCache.open(cpath, create=False) as c:
        got = c.lookup_many(hashes)
        assert all(g is None or g == blocks[i] for i, g in enumerate(got))
        assert any(g is not None for g in got)
        assert c.stats()["inserts"] >= 0  # the statistics page is still usable
        # The killed writer's path-table rows are intact: inserting and hitting works.
        c.insert(hashes[0], files[0], 0)
        with open(files[0], "rb") as f:
            first = f.read(B)
        assert c.lookup(hash_block(first)) in (None, first)

