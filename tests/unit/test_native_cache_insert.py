"""Property tests: the hash cache's batch insert in the compiled extension (``_put_many``, used by
``insert_file``, ``insert_many`` and priming) leaves the table as one ``_put`` per block does, the
reference: the same entries in every bucket (slots are picked at random by each, so compared as
sets), the same counts, torn entries treated alike; in buckets that overflow, both evict and every
entry stays intact. Malformed calls are refused."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hashcache import native
from hashcache.cache import HashCache
from hashcache.cache.format import _EVICTIONS, _INSERTS, _UPDATES, BUCKET_SIZE, BUCKETS_OFFSET, ENTRY_SIZE

pytestmark = pytest.mark.unit

prop = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FOUR_BUCKETS = 2 * 4096 + 4 * 4096


def _cache(path: Path, seed: int) -> HashCache:
    c = HashCache.open(path, FOUR_BUCKETS, evict_sample=128)
    c._rng = random.Random(seed)  # noqa: SLF001 - the same slots for the same pre-fill in both tables
    return c


def _entries(c: HashCache) -> list[Counter[bytes]]:
    """Per bucket, its non-empty entries (key, offset, file id, check, uses) as a multiset."""
    out = []
    for b in range(c.bucket_count):
        start = BUCKETS_OFFSET + b * BUCKET_SIZE
        out.append(Counter(bytes(c._mm[p:p + 28]) for p in range(start, start + BUCKET_SIZE, ENTRY_SIZE)  # noqa: SLF001
                           if c._mm[p:p + 8] != bytes(8)))  # noqa: SLF001
    return out


def _items(rng: random.Random, n: int) -> list[tuple[bytes, int, int]]:
    """(hash, file id, offset): fresh hashes, repeats at the same place and repeats moved elsewhere."""
    out: list[tuple[bytes, int, int]] = []
    for _ in range(n):
        r = rng.random()
        if out and r < 0.2:
            out.append(rng.choice(out))
        elif out and r < 0.4:
            h, _fid, _off = rng.choice(out)
            out.append((h, rng.randrange(1, 4), rng.randrange(1 << 20) * 4096))
        else:
            h = bytes(8) + rng.randbytes(24) if r > 0.97 else rng.randbytes(32)  # a zero key becomes _ONE8
            out.append((h, rng.randrange(1, 4), rng.randrange(1 << 20) * 4096))
    return out


@prop
@given(st.integers(0, 2**32), st.integers(0, 300), st.integers(1, 300), st.integers(0, 20))
def test_batch_insert_agrees(tmp_path_factory: pytest.TempPathFactory, seed: int, prefill: int, n: int,
                             torn: int) -> None:
    work = tmp_path_factory.mktemp("ins")
    rng = random.Random(seed)
    ref, nat = _cache(work / "ref.hcache", seed), _cache(work / "nat.hcache", seed)
    with ref, nat:
        first = _items(rng, prefill)
        for c in (ref, nat):
            for h, fid, off in first:
                c._put(h, fid, off)  # noqa: SLF001 - the reference, the same slots in both
        assert bytes(ref._mm[BUCKETS_OFFSET:]) == bytes(nat._mm[BUCKETS_OFFSET:])  # noqa: SLF001
        for _ in range(torn):  # spoil a check word: a torn entry, in both
            p = BUCKETS_OFFSET + rng.randrange(ref.bucket_count * BUCKET_SIZE // ENTRY_SIZE) * ENTRY_SIZE + 20
            for c in (ref, nat):
                c._mm[p] ^= 0xFF  # noqa: SLF001
        items = _items(rng, n) + rng.sample(first, min(len(first), 5))
        before = list(ref._delta)  # noqa: SLF001
        ref_written = sum(ref._put(h, fid, off) for h, fid, off in items)  # noqa: SLF001
        ref_counts = [a - b for a, b in zip(ref._delta, before, strict=True)]  # noqa: SLF001
        before = list(nat._delta)  # noqa: SLF001
        nat_written = nat._put_many(items)  # noqa: SLF001
        nat_counts = [a - b for a, b in zip(nat._delta, before, strict=True)]  # noqa: SLF001
        full = any(sum(b.values()) == BUCKET_SIZE // ENTRY_SIZE for b in _entries(ref) + _entries(nat))
        if not full:  # nothing evicted: the very same entries, counted the same
            assert _entries(nat) == _entries(ref)
            assert nat_written == ref_written
            assert (nat_counts[_INSERTS], nat_counts[_UPDATES]) == (ref_counts[_INSERTS], ref_counts[_UPDATES])
        # every entry the batch wrote is intact, and the last item is found where it was put
        h, fid, off = items[-1]
        assert (off, fid) in [(e.offset, e.file_id) for e in nat.peek(h) if e.intact]
        assert nat_written <= len(items)


def test_batch_insert_fills_and_evicts(tmp_path: Path) -> None:
    """Twice a bucket's worth of entries into one bucket: it ends full, every slot intact, and the
    batch counts as many evictions as the reference."""
    rng = random.Random(5)
    ref, nat = _cache(tmp_path / "r.hcache", 1), _cache(tmp_path / "n.hcache", 1)
    with ref, nat:
        items = [(bytes(6) + (i + 1).to_bytes(2, "big") + rng.randbytes(24), 1, i * 4096) for i in range(256)]
        for h, fid, off in items:
            ref._put(h, fid, off)  # noqa: SLF001
        assert nat._put_many(items) == 256  # noqa: SLF001
        for c in (ref, nat):
            bucket = _entries(c)[0]
            assert sum(bucket.values()) == 128
        assert nat._delta[_EVICTIONS] == ref._delta[_EVICTIONS] == 128  # noqa: SLF001
        assert all(e.intact for h, _f, _o in items for e in nat.peek(h))


@pytest.mark.parametrize("call", [
    lambda t: native.cache_put_many(t, 4, BUCKETS_OFFSET, bytes(8), [0], [1], 128, 1),     # an all-zero key
    lambda t: native.cache_put_many(t, 4, BUCKETS_OFFSET, b"k" * 8, [0], [0], 128, 1),     # file id 0
    lambda t: native.cache_put_many(t, 4, BUCKETS_OFFSET, b"k" * 7, [0], [1], 128, 1),     # a short key
    lambda t: native.cache_put_many(t, 4, BUCKETS_OFFSET, b"k" * 8, [0, 1], [1], 128, 1),  # lengths differ
    lambda t: native.cache_put_many(t, 4, BUCKETS_OFFSET, b"k" * 8, [0], [1], 0, 1),       # no sample
    lambda t: native.cache_put_many(t, 99, BUCKETS_OFFSET, b"k" * 8, [0], [1], 128, 1),    # past the table
    lambda t: native.cache_put_many(bytes(t), 4, BUCKETS_OFFSET, b"k" * 8, [0], [1], 128, 1),  # read-only
])
def test_batch_insert_refuses_malformed_calls(call) -> None:  # type: ignore[no-untyped-def]
    table = bytearray(FOUR_BUCKETS)
    with pytest.raises(ValueError):
        call(table)
    assert table == bytearray(FOUR_BUCKETS)

