"""Property tests: the compiled extension (capsule_native) and the pure-Python reference it replaced
agree on block hashes, zero detection and manifest records, byte for byte, on random block sets
(all-zero blocks, repeats, nearly-zero blocks, a short last block, holes in a file)."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hashcache import native
from hashcache.blocks import BLOCK_SIZE, hash_blocks, py_hash_blocks, py_scan_blocks, scan_blocks
from hashcache.errors import HashcacheError
from hashcache.manifest import _RecordBuilder, manifest_of_file, py_manifest_of_file

pytestmark = pytest.mark.unit

prop = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# a block: all zero, random, nearly zero (one byte set), or a repeat of an earlier one
kinds = st.sampled_from(["zero", "random", "nearly", "repeat"])


@st.composite
def block_sets(draw: st.DrawFn, max_blocks: int = 80) -> bytes:
    rng = random.Random(draw(st.integers(0, 2**32)))
    out: list[bytes] = []
    for kind in draw(st.lists(kinds, max_size=max_blocks)):
        if kind == "zero" or (kind == "repeat" and not out):
            out.append(bytes(BLOCK_SIZE))
        elif kind == "random":
            out.append(rng.randbytes(BLOCK_SIZE))
        elif kind == "nearly":
            b = bytearray(BLOCK_SIZE)
            b[rng.randrange(BLOCK_SIZE)] = rng.randrange(1, 256)
            out.append(bytes(b))
        else:
            out.append(rng.choice(out))
    tail = draw(st.integers(0, BLOCK_SIZE - 1))
    if tail:
        out.append(bytes(tail) if draw(st.booleans()) else rng.randbytes(tail))
    return b"".join(out)


@prop
@given(block_sets())
def test_hash_and_scan_agree(data: bytes) -> None:
    assert hash_blocks(data) == py_hash_blocks(data)
    assert scan_blocks(data) == py_scan_blocks(data)
    assert scan_blocks(bytearray(data), len(data) // 2) == py_scan_blocks(data, len(data) // 2)


@prop
@given(block_sets(), st.integers(0, 1 << 40), st.booleans())
def test_records_agree(data: bytes, first: int, zero_flag: bool) -> None:
    ref = _RecordBuilder()
    ref.add_hashes(first, py_scan_blocks(data), zero_flag=zero_flag)
    assert native.scan_records(memoryview(data), first, zero_flag) == ref.build()


@prop
@given(block_sets(max_blocks=40), st.lists(st.integers(0, 600), max_size=4))
def test_file_manifests_agree(tmp_path_factory: pytest.TempPathFactory, data: bytes, holes: list[int]) -> None:
    path = tmp_path_factory.mktemp("m") / "obj"
    with open(path, "wb") as f:  # data at block offsets with holes between (SEEK_DATA/SEEK_HOLE)
        pos = 0
        for h in holes:
            pos += h * BLOCK_SIZE
            f.seek(pos)
            f.write(data)
            pos += len(data) + BLOCK_SIZE - len(data) % BLOCK_SIZE
        f.write(data)
    got, ref = manifest_of_file(path), py_manifest_of_file(path)
    assert got.to_bytes() == ref.to_bytes()


def test_file_records_refuses_a_range_past_the_end(tmp_path) -> None:
    path = tmp_path / "short"
    path.write_bytes(os.urandom(3 * BLOCK_SIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(native.ShortRead):
            native.file_records(fd, 0, 4 * BLOCK_SIZE, False)
        with pytest.raises(ValueError):
            native.file_records(fd, 1, 2 * BLOCK_SIZE, False)  # not block-aligned
    finally:
        os.close(fd)
    with pytest.raises(HashcacheError):
        manifest_of_file(tmp_path)  # a directory: refused the same way as before


@prop
@given(block_sets(max_blocks=300), st.data())
def test_many_blocks_at_once_agree_with_one_at_a_time(data: bytes, draw: st.DataObject) -> None:
    """The extension hashes up to sixteen blocks per SIMD call (chunks, then parents, then roots): across
    group and task edges, zero blocks skipped in between and a short tail, each hash is BLAKE3's of that
    block alone; verification names the same first wrong block as a loop over the blocks would."""
    from blake3 import blake3

    blocks = [data[i:i + BLOCK_SIZE].ljust(BLOCK_SIZE, b"\0") for i in range(0, len(data), BLOCK_SIZE)]
    assert native.hash_blocks(data) == b"".join(blake3(b).digest() for b in blocks)
    assert scan_blocks(data) == [None if b == bytes(BLOCK_SIZE) else blake3(b).digest() for b in blocks]
    whole = b"".join(blocks)
    hash_len = draw.draw(st.sampled_from([8, 32]))
    expected = bytearray(b"".join(blake3(b).digest()[:hash_len] for b in blocks))
    assert native.verify_blocks(whole, bytes(expected), hash_len) == -1
    if blocks:
        wrong = sorted(draw.draw(st.sets(st.integers(0, len(blocks) - 1), min_size=1, max_size=3)))
        for w in wrong:
            expected[w * hash_len] ^= 0xFF
        assert native.verify_blocks(whole, bytes(expected), hash_len) == wrong[0]
