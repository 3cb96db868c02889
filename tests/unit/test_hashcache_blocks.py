"""hashcache.blocks: the definition of a block hash and the fast bulk helpers."""

from __future__ import annotations

import array
import os

import pytest
from blake3 import blake3

from hashcache.blocks import (
    ALGORITHM,
    BLOCK_SIZE,
    HASH_SIZE,
    NULL_HASH,
    ZERO_BLOCK,
    hash_block,
    hash_blocks,
    is_zero,
    scan_blocks,
)

pytestmark = pytest.mark.unit

B = BLOCK_SIZE


def test_constants() -> None:
    assert (BLOCK_SIZE, ALGORITHM, HASH_SIZE) == (4096, "blake3", 32)
    assert bytes(4096) == ZERO_BLOCK
    assert bytes(32) == NULL_HASH


def test_hash_block_is_blake3() -> None:
    data = os.urandom(B)
    assert hash_block(data) == blake3(data).digest()
    assert len(hash_block(data)) == HASH_SIZE
    assert hash_block(bytearray(data)) == hash_block(memoryview(data)) == hash_block(data)
    # Known answer: BLAKE3 of 4096 zero bytes.
    assert hash_block(ZERO_BLOCK).hex() == blake3(bytes(4096)).hexdigest()
    assert hash_block(ZERO_BLOCK) != NULL_HASH


def test_hash_block_pads_short_blocks() -> None:
    assert hash_block(b"abc") == blake3(b"abc" + bytes(B - 3)).digest()
    assert hash_block(b"") == hash_block(ZERO_BLOCK)
    with pytest.raises(ValueError, match="at most 4096"):
        hash_block(bytes(B + 1))


def test_is_zero() -> None:
    assert is_zero(ZERO_BLOCK) and is_zero(b"") and is_zero(bytes(10)) and is_zero(bytes(5 * B + 7))
    for pos in (0, 1, B // 2, B - 1):
        block = bytearray(B)
        block[pos] = 1
        assert not is_zero(block), pos
        assert not is_zero(memoryview(block))
    big = bytearray(3 * B + 100)
    big[-1] = 0x80
    assert not is_zero(big)
    big[-1] = 0
    big[2 * B] = 1
    assert not is_zero(big)


def test_hash_blocks_matches_hash_block() -> None:
    data = os.urandom(10 * B + 123)
    hashes = hash_blocks(data)
    assert len(hashes) == 11
    assert hashes[:10] == [blake3(data[i * B : (i + 1) * B]).digest() for i in range(10)]
    assert hashes[10] == hash_block(data[10 * B :])
    assert hash_blocks(memoryview(data)) == hashes == hash_blocks(bytearray(data))
    assert hash_blocks(data, length=3 * B) == hashes[:3]
    assert hash_blocks(b"") == []
    with pytest.raises(ValueError):
        hash_blocks(data, length=len(data) + 1)


def test_hash_blocks_accepts_non_byte_views() -> None:
    words = array.array("Q", range(B // 8 * 2))
    assert hash_blocks(memoryview(words)) == hash_blocks(words.tobytes())


def test_scan_blocks_marks_zero_blocks() -> None:
    data = bytearray(os.urandom(8 * B + 10))
    data[2 * B : 3 * B] = bytes(B)
    data[5 * B : 6 * B] = bytes(B)
    data[8 * B :] = bytes(10)  # a zero partial tail
    scanned = scan_blocks(data)
    full = hash_blocks(data)
    assert [i for i, h in enumerate(scanned) if h is None] == [2, 5, 8]
    assert all(s == f for s, f in zip(scanned, full, strict=True) if s is not None)
    # A single non-zero byte anywhere keeps a block.
    data[5 * B + B - 1] = 1
    assert scan_blocks(data)[5] == hash_block(data[5 * B : 6 * B])
    assert scan_blocks(memoryview(data), length=B) == [full[0]]
