"""hashcache.cache: the persistent per-host hash cache (Collective paper, section 4.4.1)."""

from __future__ import annotations

import os
import random
import shutil
import struct
import time
import zlib
from pathlib import Path

import pytest
from blake3 import blake3

import hashcache.cache as cache_mod
from hashcache import CacheError, HashCache, HashcacheError
from hashcache.blocks import BLOCK_SIZE, ZERO_BLOCK, hash_block, hash_blocks
from hashcache.cache import (
    BUCKETS_OFFSET,
    ENTRIES_PER_BUCKET,
    ENTRY_SIZE,
    remove_cache,
)
from hashcache.manifest import manifest_of_file

pytestmark = pytest.mark.unit

B = BLOCK_SIZE
HAVE_QEMU = shutil.which("qemu-img") is not None
needs_qemu = pytest.mark.skipif(not HAVE_QEMU, reason="needs qemu-img")


def content(i: int, salt: bytes = b"") -> bytes:
    """A deterministic pseudo-random block (distinct for distinct ``i`` / ``salt``)."""
    return blake3(b"hashcache-test block %d " % i + salt).digest(length=B)


def write_blocks(path: Path, blocks: list[bytes]) -> list[bytes]:
    path.write_bytes(b"".join(blocks))
    return [hash_block(b) for b in blocks]


def one_bucket_size(buckets: int = 1) -> int:
    return BUCKETS_OFFSET + buckets * B


@pytest.fixture
def cache(tmp_path: Path):
    c = HashCache.open(tmp_path / "host.hcache", size_bytes=1 << 20, readahead=0)
    yield c
    c.close()


@pytest.fixture
def image(tmp_path: Path) -> tuple[Path, list[bytes], list[bytes]]:
    """A 200-block file of distinct random-looking blocks: (path, blocks, hashes)."""
    blocks = [content(i) for i in range(200)]
    path = tmp_path / "image.raw"
    return path, blocks, write_blocks(path, blocks)


# -- basics ------------------------------------------------------------------------------------------


def test_insert_lookup_round_trip(cache: HashCache, image) -> None:
    path, blocks, hashes = image
    for i in (0, 7, 199):
        assert cache.insert(hashes[i], path, i * B) is True
    assert cache.insert(hashes[7], path, 7 * B) is False  # already there
    for i in (0, 7, 199):
        assert cache.lookup(hashes[i]) == blocks[i]
    assert cache.lookup(hashes[1]) is None  # never inserted
    assert cache.lookup(os.urandom(32)) is None
    s = cache.stats()
    assert (s["inserts"], s["hits"], s["misses"], s["used"], s["files"]) == (3, 3, 2, 3, 1)
    assert s["capacity"] == (s["size_bytes"] - BUCKETS_OFFSET) // B * ENTRIES_PER_BUCKET
    # The same file by id, and through insert_many.
    fid = cache.file_id(path)
    assert cache.insert_many([(hashes[i], fid, i * B) for i in range(10, 20)] + [(hashes[20], str(path), 20 * B)]) == 11
    assert cache.lookup_many([hashes[15], os.urandom(32), hashes[20]]) == [blocks[15], None, blocks[20]]


def test_zero_block_is_known_without_an_entry(cache: HashCache, tmp_path: Path) -> None:
    zero_hash = hash_block(ZERO_BLOCK)
    (tmp_path / "z").write_bytes(bytes(B))
    assert cache.insert(zero_hash, tmp_path / "z", 0) is False
    assert cache.lookup(zero_hash) == ZERO_BLOCK
    assert cache.stats()["used"] == 0


def test_bad_arguments(cache: HashCache, image) -> None:
    path, _, hashes = image
    with pytest.raises(ValueError, match="32 bytes"):
        cache.lookup(b"short")
    with pytest.raises(ValueError):
        cache.insert(hashes[0], path, -1)
    with pytest.raises(FileNotFoundError):
        cache.insert(hashes[0], path.parent / "missing", 0)
    with pytest.raises(HashcacheError, match="not a regular file"):
        cache.insert(hashes[0], path.parent, 0)


def test_insert_file_from_manifest_hash_list_and_records(cache: HashCache, tmp_path: Path) -> None:
    path = tmp_path / "mem.img"
    blocks = [content(i) for i in range(6)]
    with open(path, "wb") as f:
        f.truncate(50 * B + 100)  # holes, and a short last block
        for i, b in zip((0, 1, 4, 9, 30, 31), blocks, strict=True):
            f.seek(i * B)
            f.write(b)
        f.seek(50 * B)
        f.write(b"\x42" * 100)
    m = manifest_of_file(path)
    assert cache.insert_file(path, m) == 7
    for i, b in zip((0, 1, 4, 9, 30, 31), blocks, strict=True):
        assert cache.lookup(m.hash_of(i)) == b
    # The short tail comes back zero-padded: that is what its hash covers.
    assert cache.lookup(m.hash_of(50)) == b"\x42" * 100 + bytes(B - 100)

    other = tmp_path / "other.img"
    more = [content(i, b"other") for i in range(4)]
    hashes = write_blocks(other, more)
    assert cache.insert_file(other, [hashes[0], None, hashes[2]]) == 2
    assert cache.insert_file(other, [(1, hashes[1]), (3, False, hashes[3])]) == 2
    assert cache.lookup_many(hashes) == more


# -- invalidation --------------------------------------------------------------------------------------


def test_changed_data_invalidates_then_plain_miss(cache: HashCache, image) -> None:
    path, blocks, hashes = image
    cache.insert_file(path, hashes)
    with open(path, "r+b") as f:
        f.seek(5 * B)
        f.write(content(5, b"changed"))
    assert cache.lookup(hashes[5]) is None
    s = cache.stats()
    assert (s["invalidations"], s["misses"], s["hits"]) == (1, 1, 0)
    assert cache.peek(hashes[5]) == []  # the entry is gone
    assert cache.lookup(hashes[5]) is None
    s = cache.stats()
    assert (s["invalidations"], s["misses"]) == (1, 2)
    assert cache.lookup(hashes[6]) == blocks[6]  # the rest of the file still serves


def test_deleted_file_misses(cache: HashCache, image) -> None:
    path, blocks, hashes = image
    cache.insert_file(path, hashes)
    assert cache.lookup(hashes[3]) == blocks[3]  # the descriptor is now cached
    path.unlink()
    assert cache.lookup(hashes[4]) is None
    assert cache.lookup(hashes[5]) is None
    assert cache.stats()["files"] == 0  # the row of a vanished file is dropped


def test_replaced_file_misses_without_reading(cache: HashCache, image, tmp_path: Path) -> None:
    path, blocks, hashes = image
    cache.insert_file(path, hashes)
    # Same bytes under the same name, but another inode: detected by (st_dev, st_ino), nothing read.
    new = tmp_path / "new.raw"
    new.write_bytes(path.read_bytes())
    os.replace(new, path)
    reads = cache.disk_reads
    assert cache.lookup(hashes[0]) is None
    assert cache.lookup(hashes[1]) is None
    assert cache.disk_reads == reads
    # Inserting the new file gives it a new id; its blocks hit again.
    cache.insert_file(path, hashes)
    assert cache.lookup(hashes[0]) == blocks[0]


def test_forget_path(cache: HashCache, image) -> None:
    path, _, hashes = image
    cache.insert_file(path, hashes)
    assert cache.forget_path(path) is True
    assert cache.forget_path(path) is False
    assert cache.lookup(hashes[0]) is None


def test_unreadable_file_is_a_miss_but_keeps_its_entries(
    cache: HashCache, image, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, blocks, hashes = image
    cache.insert_file(path, hashes)
    real_open = os.open

    def denied(p: str, *args: object, **kwargs: object) -> int:
        if p == str(path):
            raise PermissionError(13, "Permission denied", p)
        return real_open(p, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cache_mod.os, "open", denied)
    assert cache.lookup(hashes[0]) is None
    assert cache.stats()["invalidations"] == 0 and len(cache.peek(hashes[0])) == 1
    monkeypatch.setattr(cache_mod.os, "open", real_open)
    assert cache.lookup(hashes[0]) == blocks[0]


def test_reopened_cache_reads_a_rewritten_file_correctly(tmp_path: Path, image) -> None:
    """Inode reuse or in-place rewrites: identity matches, the data does not -> verification."""
    path, blocks, hashes = image
    with HashCache.open(tmp_path / "c", size_bytes=1 << 20) as c:
        c.insert_file(path, hashes)
    with open(path, "r+b") as f:
        f.write(content(0, b"x"))
    with HashCache.open(tmp_path / "c") as c:
        assert c.lookup(hashes[0]) is None
        assert c.lookup(hashes[1]) == blocks[1]
        assert c.stats()["invalidations"] == 1


# -- eviction and use counts ---------------------------------------------------------------------------


def test_use_counts_increase_on_hits(tmp_path: Path, image) -> None:
    path, blocks, hashes = image
    with HashCache.open(tmp_path / "c", size_bytes=1 << 20) as c:
        c.insert_file(path, hashes)
        assert [e.uses for e in c.peek(hashes[10])] == [0]
        for n in range(1, 4):
            assert c.lookup(hashes[10]) == blocks[10]
            assert [e.uses for e in c.peek(hashes[10])] == [n]
        # A hit served from read-ahead counts too.
        assert c.lookup(hashes[11]) == blocks[11]
        assert [e.uses for e in c.peek(hashes[11])] == [1]
        assert c.stats()["readahead_hits"] == 1


def test_full_bucket_evicts_the_least_used(tmp_path: Path) -> None:
    """With one bucket every hash shares it; sampling every slot must evict the one never hit."""
    blocks = [content(i) for i in range(ENTRIES_PER_BUCKET + 1)]
    path = tmp_path / "f"
    hashes = write_blocks(path, blocks)
    with HashCache.open(tmp_path / "c", size_bytes=one_bucket_size(), evict_sample=ENTRIES_PER_BUCKET) as c:
        assert c.capacity == ENTRIES_PER_BUCKET
        assert c.insert_file(path, hashes[:ENTRIES_PER_BUCKET]) == ENTRIES_PER_BUCKET
        assert c.stats()["used"] == ENTRIES_PER_BUCKET and c.stats()["evictions"] == 0
        cold = 77
        for i in range(ENTRIES_PER_BUCKET):
            if i != cold:
                assert c.lookup(hashes[i]) == blocks[i]
        assert c.insert(hashes[-1], path, ENTRIES_PER_BUCKET * B)
        s = c.stats()
        assert (s["evictions"], s["used"]) == (1, ENTRIES_PER_BUCKET)
        assert c.peek(hashes[cold]) == []
        assert c.lookup(hashes[-1]) == blocks[-1]
        assert all(c.peek(hashes[i]) for i in range(ENTRIES_PER_BUCKET) if i != cold)


def test_eviction_prefers_a_torn_entry(tmp_path: Path) -> None:
    n = ENTRIES_PER_BUCKET
    blocks = [content(i) for i in range(n + 1)]
    path = tmp_path / "f"
    hashes = write_blocks(path, blocks)
    cpath = tmp_path / "c"
    with HashCache.open(cpath, size_bytes=one_bucket_size(), evict_sample=n, readahead=0) as c:
        c.insert_file(path, hashes[:n])
        assert c.lookup_many(hashes[:n]) == blocks[:n]  # every entry has been used once
        torn = c.peek(hashes[40])[0].position
        c._mm[torn + 8 : torn + 16] = os.urandom(8)  # a torn write: the check word no longer matches
        assert c.peek(hashes[40])[0].intact is False
        c.insert(hashes[n], path, n * B)
        assert c.peek(hashes[40]) == [] and c.lookup(hashes[n]) == blocks[n]
        assert all(len(c.peek(hashes[i])) == 1 for i in range(n) if i != 40)


def test_sampled_eviction_spares_hot_entries(tmp_path: Path) -> None:
    """Default sampling (16 of 128 slots): entries with hits survive a stream of new inserts."""
    n = ENTRIES_PER_BUCKET
    blocks = [content(i) for i in range(n + 64)]
    path = tmp_path / "f"
    hashes = write_blocks(path, blocks)
    with HashCache.open(tmp_path / "c", size_bytes=one_bucket_size(), readahead=0) as c:
        assert c.evict_sample == 16
        c.insert_file(path, hashes[:n])
        hot = range(0, n, 2)
        for i in hot:
            for _ in range(3):
                assert c.lookup(hashes[i]) == blocks[i]
        for i in range(n, n + 64):
            c.insert(hashes[i], path, i * B)
        assert c.stats()["evictions"] == 64
        assert all(c.peek(hashes[i]) for i in hot)  # only never-hit entries were replaced


def test_crafted_hashes_sharing_a_bucket(tmp_path: Path) -> None:
    """In a multi-bucket cache, blocks whose hashes share a bucket evict each other, others do not."""
    path = tmp_path / "f"
    blocks = [content(i) for i in range(2000)]
    hashes = write_blocks(path, blocks)
    with HashCache.open(tmp_path / "c", size_bytes=one_bucket_size(4), evict_sample=ENTRIES_PER_BUCKET) as c:
        by_bucket: dict[int, list[int]] = {}
        for i, h in enumerate(hashes):
            by_bucket.setdefault(c._bucket(h), []).append(i)
        crowded = max(by_bucket.values(), key=len)
        assert len(crowded) > ENTRIES_PER_BUCKET
        c.insert_many((hashes[i], path, i * B) for i in crowded[: ENTRIES_PER_BUCKET + 10])
        assert c.stats()["evictions"] == 10
        assert c.stats()["used"] == ENTRIES_PER_BUCKET


# -- persistence ---------------------------------------------------------------------------------------


def test_persistence_across_close_and_reopen(tmp_path: Path, image) -> None:
    path, blocks, hashes = image
    cpath = tmp_path / "c"
    with HashCache.open(cpath, size_bytes=256 * 1024) as c:
        c.insert_file(path, hashes)
        assert c.lookup(hashes[0]) == blocks[0]
        size, capacity = c.size_bytes, c.capacity
    assert os.path.getsize(cpath) == size == 256 * 1024
    with HashCache.open(cpath, size_bytes=1 << 30, create=False) as c:  # the size is fixed at creation
        assert (c.size_bytes, c.capacity) == (size, capacity)
        assert c.lookup_many(hashes[100:110]) == blocks[100:110]
        s = c.stats()
        assert (s["inserts"], s["hits"], s["used"]) == (200, 11, 200)


def test_open_missing_without_create(tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="does not exist"):
        HashCache.open(tmp_path / "nope", create=False)
    assert not (tmp_path / "nope").exists()


def test_recreated_cache_resets_stale_path_table(tmp_path: Path, image) -> None:
    path, _, hashes = image
    cpath = tmp_path / "c"
    with HashCache.open(cpath, size_bytes=1 << 20) as c:
        c.insert_file(path, hashes)
    os.unlink(cpath)  # the user deletes the cache file only
    with HashCache.open(cpath, size_bytes=1 << 20) as c:
        assert c.stats()["files"] == 0 and c.stats()["used"] == 0
        assert c.lookup(hashes[0]) is None
    remove_cache(cpath)
    assert not any(p.name.startswith("c") for p in tmp_path.iterdir())


# -- corruption --------------------------------------------------------------------------------------


def test_corrupt_header_is_a_clear_error(tmp_path: Path) -> None:
    cpath = tmp_path / "c"
    HashCache.open(cpath, size_bytes=1 << 20).close()
    with open(cpath, "r+b") as f:
        f.seek(40)  # inside the bucket count
        f.write(b"\x07")
    with pytest.raises(CacheError) as e:
        HashCache.open(cpath)
    assert str(cpath) in str(e.value) and "checksum" in str(e.value) and "delete it" in str(e.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "bad magic"),
        (b"SQLite format 3\x00" + os.urandom(5000), "bad magic"),
        (cache_mod.MAGIC + b"\x01\x00", "truncated"),
    ],
)
def test_foreign_or_truncated_file_is_a_clear_error(tmp_path: Path, data: bytes, message: str) -> None:
    cpath = tmp_path / "c"
    cpath.write_bytes(data)
    with pytest.raises(CacheError, match=message) as e:
        HashCache.open(cpath)
    assert str(cpath) in str(e.value) and "delete it" in str(e.value)
    assert cpath.read_bytes() == data  # never "repaired" behind the user's back


def test_truncated_cache_is_a_clear_error(tmp_path: Path) -> None:
    cpath = tmp_path / "c"
    HashCache.open(cpath, size_bytes=1 << 20).close()
    os.truncate(cpath, 1 << 19)
    with pytest.raises(CacheError, match="truncated"):
        HashCache.open(cpath)


def test_corrupt_path_table_is_a_clear_error(tmp_path: Path) -> None:
    cpath = tmp_path / "c"
    HashCache.open(cpath, size_bytes=1 << 20).close()
    Path(str(cpath) + ".files").write_bytes(b"garbage" * 1000)
    with pytest.raises(CacheError, match="delete it"):
        HashCache.open(cpath)


def test_torn_entries_cost_only_a_miss(tmp_path: Path, image) -> None:
    path, blocks, hashes = image
    cpath = tmp_path / "c"
    with HashCache.open(cpath, size_bytes=1 << 20, readahead=0) as c:
        c.insert_file(path, hashes)
        pos = [c.peek(hashes[i])[0].position for i in range(4)]
        fid = c.file_id(path)
    with open(cpath, "r+b") as f:
        # 0: key intact, the rest garbage (the check word rejects it without a read).
        f.seek(pos[0] + 8)
        f.write(os.urandom(ENTRY_SIZE - 8))
        # 1: a consistent entry pointing at the wrong block (verification rejects it).
        key = hashes[1][:8]
        head = struct.pack("<8sQI", key, 50 * B, fid)
        f.seek(pos[1])
        f.write(head + struct.pack("<III", zlib.crc32(head), 9, 0))
        # 2: a consistent entry pointing past the end of the file.
        head = struct.pack("<8sQI", hashes[2][:8], 10**9, fid)
        f.seek(pos[2])
        f.write(head + struct.pack("<III", zlib.crc32(head), 0, 0))
        # 3: half of the entry from another one (a torn write).
        f.seek(pos[3] + 8)
        f.write(os.urandom(8))
    with HashCache.open(cpath, readahead=0) as c:
        assert c.lookup(hashes[0]) is None
        assert c.disk_reads == 0
        assert c.lookup(hashes[1]) is None
        assert c.lookup(hashes[2]) is None
        assert c.lookup(hashes[3]) is None
        assert c.stats()["invalidations"] == 2
        assert c.lookup_many(hashes[4:]) == blocks[4:]
        # Re-inserting repairs the torn slots in place.
        c.insert_file(path, hashes[:4])
        assert c.lookup_many(hashes[:4]) == blocks[:4]


def test_garbage_bucket_never_returns_wrong_data(tmp_path: Path, image) -> None:
    """Fill every slot with random bytes that still carry the right keys and check words."""
    path, blocks, hashes = image
    cpath = tmp_path / "c"
    with HashCache.open(cpath, size_bytes=one_bucket_size(), readahead=0) as c:
        fid = c.file_id(path)
    rng = random.Random(1)
    with open(cpath, "r+b") as f:
        for slot in range(ENTRIES_PER_BUCKET):
            key = hashes[slot][:8]
            off = rng.randrange(0, 220) * B + rng.choice((0, 0, 1, 2048))
            head = struct.pack("<8sQI", key, off, fid)
            f.seek(BUCKETS_OFFSET + slot * ENTRY_SIZE)
            f.write(head + struct.pack("<III", zlib.crc32(head), rng.randrange(100), 0))
    with HashCache.open(cpath, readahead=0) as c:
        for i in range(ENTRIES_PER_BUCKET):
            got = c.lookup(hashes[i])
            assert got is None or got == blocks[i]


# -- read-ahead --------------------------------------------------------------------------------------


def test_readahead_serves_following_blocks_without_reads(
    tmp_path: Path, image, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, blocks, hashes = image
    with HashCache.open(tmp_path / "c", size_bytes=1 << 20, readahead=16) as c:
        c.insert_file(path, hashes)
        preads: list[tuple[int, int]] = []
        real_pread = os.pread

        def counting_pread(fd: int, n: int, offset: int) -> bytes:
            preads.append((n, offset))
            return real_pread(fd, n, offset)

        monkeypatch.setattr(cache_mod.os, "pread", counting_pread)
        assert c.lookup(hashes[10]) == blocks[10]
        assert preads == [(9 * B, 10 * B)]  # the block and the first window (8) after it, in one read
        for i in range(11, 19):
            assert c.lookup(hashes[i]) == blocks[i]
        assert len(preads) == 1 and c.disk_reads == 1
        assert c.stats()["readahead_hits"] == 8
        # The window was used, so the next read is wider (up to readahead=16).
        assert c.lookup(hashes[19]) == blocks[19]
        assert preads[1] == (17 * B, 19 * B)
        for i in range(20, 36):
            assert c.lookup(hashes[i]) == blocks[i]
        assert len(preads) == 2 and c.stats()["readahead_hits"] == 24
        # An unused window shrinks the next one back: random lookups do not read 16 blocks each.
        assert c.lookup(hashes[150]) == blocks[150]
        assert preads[2] == (17 * B, 150 * B)
        assert c.lookup(hashes[60]) == blocks[60]
        assert preads[3] == (9 * B, 60 * B)
        # A primed block is found by hash, and the file changing afterwards does not matter.
        with open(path, "r+b") as f:
            f.seek(61 * B)
            f.write(content(61, b"new"))
        assert c.lookup(hashes[61]) == blocks[61]
        assert len(preads) == 4


def test_primed_block_serves_a_lookup_whose_entry_points_elsewhere(tmp_path: Path, image) -> None:
    """Two files share a run; the table points its second block at the other file: still no read."""
    path, blocks, hashes = image
    other = tmp_path / "other"
    other.write_bytes(content(0, b"pad") + b"".join(blocks[50:60]))
    with HashCache.open(tmp_path / "c", size_bytes=1 << 20, readahead=8) as c:
        c.insert_file(path, hashes)
        c.insert(hashes[51], other, 2 * B)  # the table now says block 51 lies in `other`
        assert c.lookup(hashes[50]) == blocks[50]
        reads = c.disk_reads
        assert c.lookup(hashes[51]) == blocks[51]
        assert c.disk_reads == reads


def test_readahead_restores_evicted_entries(tmp_path: Path, image) -> None:
    path, blocks, hashes = image
    with HashCache.open(tmp_path / "c", size_bytes=1 << 20, readahead=8) as c:
        c.insert_file(path, hashes)
        assert c.lookup(hashes[0]) == blocks[0]
        pos = c.peek(hashes[3])[0].position
        c._mm[pos : pos + 8] = bytes(8)  # evicted meanwhile (by another process, say)
        assert c.peek(hashes[3]) == []
        assert c.lookup(hashes[3]) == blocks[3]
        assert [(e.offset, e.uses) for e in c.peek(hashes[3])] == [(3 * B, 0)]


def test_lookup_many_reads_in_file_order(tmp_path: Path, image) -> None:
    path, blocks, hashes = image
    with HashCache.open(tmp_path / "c", size_bytes=1 << 20, readahead=63) as c:
        c.insert_file(path, hashes)
        order = list(range(128))
        random.Random(3).shuffle(order)
        got = c.lookup_many([hashes[i] for i in order])
        assert got == [blocks[i] for i in order]
        # Windows of 1+8 blocks, then (used, so widened to the maximum) 1+63 and 1+63: three reads
        # for 128 blocks asked in random order.
        assert c.disk_reads == 3


# -- prime_paths ---------------------------------------------------------------------------------------


def test_prime_paths_indexes_a_directory(tmp_path: Path) -> None:
    top = tmp_path / "disks"
    (top / "sub" / "deeper").mkdir(parents=True)
    a = [content(i, b"a") for i in range(8)]
    write_blocks(top / "a.img", a)
    sparse = top / "sub" / "deeper" / "sparse.qcow2"  # any file is indexed as raw bytes
    with open(sparse, "wb") as f:
        f.truncate(1000 * B + 10)
        f.seek(3 * B)
        f.write(content(3, b"s"))
        f.seek(700 * B)
        f.write(bytes(B) + content(701, b"s"))  # a written zero block, then data
        f.seek(1000 * B)
        f.write(b"tail!!!!!!")
    (top / "sub" / "link.img").symlink_to(top / "a.img")  # the same file twice: indexed once
    (top / "empty").write_bytes(b"")
    cpath = top / "cache.hc"  # the cache itself lives in the tree and is skipped
    calls: list[tuple[int, int]] = []
    with HashCache.open(cpath, size_bytes=1 << 20) as c:
        r = c.prime_paths([top], progress=lambda done, total: calls.append((done, total)))
        assert (r.files, r.skipped, r.blocks, r.errors) == (2, 0, 11, [])
        assert r.bytes_read < 100 * B  # holes were skipped
        assert calls and calls[-1][0] == calls[-1][1] and all(d <= t for d, t in calls)
        assert c.lookup_many([hash_block(b) for b in a]) == a
        assert c.lookup(hash_block(content(3, b"s"))) == content(3, b"s")
        assert c.lookup(hash_block(content(701, b"s"))) == content(701, b"s")
        assert c.lookup(hash_block(b"tail!!!!!!")) == b"tail!!!!!!" + bytes(B - 10)
        assert c.stats()["used"] == 11  # zero blocks and holes take no entries

        # Unchanged files are skipped next time; a changed one is indexed again.
        r = c.prime_paths(top)
        assert (r.files, r.skipped, r.blocks) == (0, 2, 0)
        new = content(9, b"a")
        with open(top / "a.img", "ab") as f:
            f.write(new)
        os.utime(top / "a.img", ns=(time.time_ns(), time.time_ns() + 10**9))
        r = c.prime_paths(top)
        assert (r.files, r.skipped, r.blocks) == (1, 1, 1)
        assert c.lookup(hash_block(new)) == new
        r = c.prime_paths(top, force=True)
        assert (r.files, r.skipped, r.blocks) == (2, 0, 0)  # everything already there


def test_prime_paths_reports_unreadable_files(tmp_path: Path, cache: HashCache) -> None:
    top = tmp_path / "top"
    top.mkdir()
    good = [content(1)]
    write_blocks(top / "good", good)
    (top / "dangling").symlink_to(tmp_path / "gone")
    (top / "fifo").unlink(missing_ok=True)
    os.mkfifo(top / "fifo")  # not a regular file: ignored, never opened
    expected_errors = 2
    if os.geteuid() != 0:  # root reads everything
        write_blocks(top / "secret", [content(2)])
        (top / "secret").chmod(0)
        expected_errors += 1
    r = cache.prime_paths([top, tmp_path / "missing"])
    assert r.files == 1 and r.blocks == 1 and len(r.errors) == expected_errors, r.errors
    assert any("dangling" in e for e in r.errors) and any("missing" in e for e in r.errors)
    assert cache.lookup(hash_block(good[0])) == good[0]


# -- several processes --------------------------------------------------------------------------------


def test_thread_safety_of_one_object(tmp_path: Path, image) -> None:
    import threading

    path, blocks, hashes = image
    with HashCache.open(tmp_path / "c", size_bytes=one_bucket_size(2)) as c:
        c.insert_file(path, hashes)
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(300):
                    i = rng.randrange(200)
                    got = c.lookup(hashes[i])
                    assert got is None or got == blocks[i]
                    c.insert(hashes[i], path, i * B)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []


def test_hash_blocks_agree_with_lookup_padding(cache: HashCache, tmp_path: Path) -> None:
    """A file whose size is not a multiple of 4 KiB: every manifest hash finds its block."""
    data = os.urandom(5 * B + 123)
    path = tmp_path / "odd"
    path.write_bytes(data)
    hashes = hash_blocks(data)
    cache.insert_file(path, hashes)
    padded = data + bytes(B - 123)
    assert cache.lookup_many(hashes) == [padded[i * B : (i + 1) * B] for i in range(6)]


def test_lookup_by_prefix(tmp_path):
    data = os.urandom(BLOCK_SIZE * 4)
    f = tmp_path / "file.bin"
    f.write_bytes(data)
    hashes = hash_blocks(data)
    with HashCache.open(tmp_path / "c.bin", size_bytes=1 << 20) as cache:
        cache.insert_file(f, hashes)
        got = cache.lookup_prefix(hashes[1][:8])
        assert got == (data[BLOCK_SIZE:2 * BLOCK_SIZE], hashes[1])
        # served again from the read-ahead of the first hit
        assert cache.lookup_prefix(hashes[2][:8]) == (data[2 * BLOCK_SIZE:3 * BLOCK_SIZE], hashes[2])
        assert cache.lookup_prefix(b"\x01" * 8) is None
        f.write_bytes(os.urandom(len(data)))  # changed underneath: the prefix no longer matches
        cache.clear_readahead()
        assert cache.lookup_prefix(hashes[3][:8]) is None
        with pytest.raises(ValueError):
            cache.lookup_prefix(b"short")


def test_the_cache_and_its_path_table_are_their_owners_alone(tmp_path: Path) -> None:
    """They name every indexed file and its block hashes; a store's directories let QEMU's group pass, so a
    readable cache would show a confined guest what the host holds. Caches made as 0644 are narrowed."""
    old = os.umask(0o022)
    try:
        path = tmp_path / "cache.bin"
        data = tmp_path / "data"
        hashes = write_blocks(data, [content(i) for i in range(4)])
        with HashCache.open(path, size_bytes=1 << 20) as c:
            c.insert(hashes[1], data, B)
        files = [p for p in tmp_path.iterdir() if p.name.startswith("cache.bin")]
        assert {p.name for p in files} >= {"cache.bin", "cache.bin.files"}
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: "0o600" for p in files}
        for p in files:
            os.chmod(p, 0o644)                           # as a cache made by 0.1.0
        with HashCache.open(path) as c:
            assert c.lookup(hash_block(content(1))) == content(1)
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in files if p.exists()} == \
               {p.name: "0o600" for p in files if p.exists()}
    finally:
        os.umask(old)
