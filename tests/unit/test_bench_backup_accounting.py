"""B4's "after hashing" accounting: a block counts once over the whole series, zero blocks never, the
starting image is known but not counted; compression and qemu-img map sums."""

from __future__ import annotations

import os
import zlib

import pytest
import zstandard

from bench.backup_accounting import BLOCK, Seen, allocated_bytes, compressed_sizes

pytestmark = pytest.mark.unit


def rec(index: int, h: bytes, zero: bool = False) -> tuple[int, bool, bytes]:
    return index, zero, h.ljust(32, b"\0")


def key(h: bytes) -> bytes:
    return h.ljust(32, b"\0")


def test_the_image_is_known_and_not_counted() -> None:
    seen = Seen()
    seen.add_known([rec(0, b"base-a"), rec(1, b"base-b"), rec(2, b"", zero=True)])
    new = seen.take("disk", [rec(5, b"base-a"), rec(6, b"fresh"), rec(7, b"base-b")])
    assert new.indices == [6]
    assert new.nbytes == BLOCK
    assert len(seen) == 3


def test_duplicates_within_an_object_count_once_at_their_first_index() -> None:
    new = Seen().take("memory", [rec(3, b"x"), rec(4, b"y"), rec(9, b"x"), rec(10, b"x")])
    assert new.indices == [3, 4]


def test_zero_blocks_are_never_counted_nor_remembered() -> None:
    seen = Seen()
    zero_hash = b"z"
    new = seen.take("disk", [rec(0, zero_hash, zero=True), rec(1, b"d")])
    assert new.indices == [1]
    assert key(zero_hash) not in seen


def test_blocks_seen_in_an_earlier_snapshot_or_the_memory_are_not_new_again() -> None:
    seen = Seen()
    first_mem = seen.take("memory", [rec(0, b"page1"), rec(1, b"page2")])
    first_disk = seen.take("disk", [rec(0, b"page2"), rec(1, b"file1")])   # page2 counted with the memory
    second_mem = seen.take("memory", [rec(0, b"page1"), rec(1, b"page3"), rec(2, b"file1")])
    assert (first_mem.indices, first_disk.indices, second_mem.indices) == ([0, 1], [1], [1])


def test_compressed_sizes_are_those_of_one_zstd_frame_and_one_gzip_stream() -> None:
    chunks = [b"a" * 10000, os.urandom(5000), b"hello" * 300]
    data = b"".join(chunks)
    c = compressed_sizes(iter(chunks))
    assert c.raw == len(data)
    frame = _zstd(chunks)
    assert zstandard.ZstdDecompressor().decompressobj().decompress(frame) == data
    assert c.zstd == len(frame)
    assert 5000 < c.zstd < 6000            # the random part stays, the rest nearly vanishes
    assert c.gzip == len(_gzip(data))
    assert zlib.decompress(_gzip(data), 31) == data


def _zstd(chunks: list[bytes]) -> bytes:
    z = zstandard.ZstdCompressor(level=3).compressobj()
    return b"".join(z.compress(ch) for ch in chunks) + z.flush()


def _gzip(data: bytes) -> bytes:
    g = zlib.compressobj(6, zlib.DEFLATED, 31)
    return g.compress(data) + g.flush()


def test_nothing_compresses_to_an_empty_frame() -> None:
    c = compressed_sizes(iter([]))
    assert c.raw == 0 and 0 < c.zstd < 32 and 0 < c.gzip < 32


def test_allocated_bytes_counts_data_in_the_image_itself() -> None:
    extents = [
        {"start": 0, "length": 65536, "depth": 0, "present": True, "zero": False, "data": True},
        {"start": 65536, "length": 131072, "depth": 1, "present": False, "zero": True, "data": False},
        {"start": 196608, "length": 65536, "depth": 0, "present": True, "zero": True, "data": False},
        {"start": 262144, "length": 4096, "depth": 0, "present": True, "zero": False, "data": True},
        {"start": 266240, "length": 8192, "depth": 1, "present": True, "zero": False, "data": True},
    ]
    assert allocated_bytes(extents) == 65536 + 4096
