"""Property tests: the hash cache's batch lookup (bucket search and verified reads in the compiled
extension) answers exactly as one ``lookup_prefix`` per block, the reference, when read-ahead is off —
hits, misses, and entries whose file changed after it was indexed (refused, never returned) — and a
receiver's plan built on it fetches, copies and counts the same blocks as the reference plan. With
read-ahead on, the reference may find more (a block whose own entry is gone but that sits after a
hit); the batch finds a subset of those blocks, with the same data."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hashcache.blocks import BLOCK_SIZE, hash_block
from hashcache.cache import HashCache
from hashcache.hcp import Expectation, Receiver
from hashcache.manifest import manifest_of_file
from hashcache.shadow import Shadow

pytestmark = pytest.mark.unit

prop = settings(max_examples=10, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
SMALL_CACHE = 2 * 4096 + 4 * 4096  # four buckets: collisions and full buckets are common


def _world(work: Path, seed: int, n: int, known: float, spoil: int, tail: int,
           readahead: int = 0) -> tuple[list[bytes], list[HashCache]]:
    """``n`` blocks (some repeats and zeros); a file holding a ``known`` share of them (plus a short
    tail) indexed by two identical caches; then ``spoil`` blocks of that file overwritten."""
    rng = random.Random(seed)
    blocks: list[bytes] = []
    for _ in range(n):
        r = rng.random()
        blocks.append(bytes(BLOCK_SIZE) if r < 0.15 else rng.choice(blocks) if r < 0.3 and blocks
                      else rng.randbytes(BLOCK_SIZE))
    held = [b for b in blocks if rng.random() < known]
    rng.shuffle(held)
    local = work / "local.img"
    local.write_bytes(b"".join(held) + rng.randbytes(tail))
    caches = []
    for name in ("a", "b"):
        c = HashCache.open(work / f"{name}.hcache", SMALL_CACHE, readahead=readahead, readahead_capacity=16)
        c.prime_paths([local])
        caches.append(c)
    with open(local, "r+b") as f:
        for _ in range(spoil if held else 0):
            f.seek(rng.randrange(len(held)) * BLOCK_SIZE)
            f.write(rng.randbytes(BLOCK_SIZE))
    return blocks, caches


@prop
@given(st.integers(0, 2**32), st.integers(1, 60), st.floats(0, 1), st.integers(0, 6), st.integers(0, BLOCK_SIZE - 1),
       st.sampled_from([0, 8]))
def test_batch_lookup_agrees(tmp_path_factory: pytest.TempPathFactory, seed: int, n: int, known: float,
                             spoil: int, tail: int, readahead: int) -> None:
    work = tmp_path_factory.mktemp("c")
    blocks, (a, b) = _world(work, seed, n, known, spoil, tail, readahead)
    prefixes = [hash_block(x)[:8] for x in blocks] + [bytes(8)]
    try:
        got = a.lookup_prefix_many(prefixes)
        want = [b.lookup_prefix(p) for p in prefixes]
        if readahead:
            assert all(g is None or g == w for g, w in zip(got, want, strict=True))
        else:
            assert got == want
        for p, hit in zip(prefixes, got, strict=True):  # and a hit is always right
            assert hit is None or (hash_block(hit[0]) == hit[1] and hit[1][:8] == p)
    finally:
        a.close()
        b.close()


@prop
@given(st.integers(0, 2**32), st.integers(1, 60), st.floats(0, 1), st.integers(0, 6), st.booleans())
def test_plans_agree(tmp_path_factory: pytest.TempPathFactory, seed: int, n: int, known: float, spoil: int,
                     dedupe: bool) -> None:
    work = tmp_path_factory.mktemp("p")
    blocks, (a, b) = _world(work, seed, n, known, spoil, 0)
    obj = work / "object"
    obj.write_bytes(b"".join(blocks))
    m = manifest_of_file(obj)
    expect = Expectation.part_of(m, 0, len(m), 8)

    class OneByOne:  # the reference: no batch method, so plan() takes its per-block path
        lookup = b.lookup
        lookup_prefix = b.lookup_prefix

    results = []
    try:
        for name, cache in (("native", a), ("reference", OneByOne())):
            with Shadow(work / name, m.block_count) as sh:
                r = Receiver(expect, sh, "file x", cache, dedupe=dedupe)  # type: ignore[arg-type]
                still = r.plan()
                results.append((still, r.stats.cache_bytes, sorted(i for i in range(m.block_count) if sh.has(i)),
                                sh.read_run(0, m.block_count)))
    finally:
        a.close()
        b.close()
    assert results[0] == results[1]
