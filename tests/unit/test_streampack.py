"""The disks' channel packed with zstd (capsule/migrate/streampack.py): the same bytes back in any cuts, fewer on
the wire when they compress, and hostile frames refused with the reason."""

from __future__ import annotations

import os
import struct

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from capsule.errors import IntegrityError
from capsule.migrate.streampack import MAX_RAW, Packer, Unpacker

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _unpack(wire: bytes, cuts: list[int]) -> bytes:
    u, out, at, i = Unpacker(), bytearray(), 0, 0
    while at < len(wire):
        n = cuts[i % len(cuts)] if cuts else len(wire)
        out += u.decode(wire[at:at + n])
        at, i = at + n, i + 1
    u.finish()
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.one_of(st.binary(max_size=5000), st.builds(lambda n: b"ab" * n, st.integers(0, 40000))),
                       max_size=12),
       cuts=st.lists(st.integers(1, 70000), max_size=5))
def test_any_chunks_come_back_exactly_in_any_cuts(chunks, cuts):
    p = Packer()
    wire = b"".join(p.encode(c) for c in chunks) + p.finish()
    assert _unpack(wire, cuts) == b"".join(chunks)
    assert p.stats.raw_bytes == sum(map(len, chunks)) and p.stats.wire_bytes == len(wire)


def test_compressible_writes_shrink_and_a_chunk_is_never_held_back():
    p, u = Packer(), Unpacker()
    text = b"".join(b"line %d of a document\n" % i for i in range(3000))
    wire = p.encode(text)
    assert len(wire) < len(text) // 4
    assert u.decode(wire) == text                      # all of it at once: NBD waits for each reply
    big = os.urandom(MAX_RAW + 5)                      # beyond one frame: two
    assert u.decode(p.encode(big)) == big


@pytest.mark.parametrize("size", [131_073, 600_000, MAX_RAW])
def test_a_compressible_frame_larger_than_a_zstd_block_comes_back_whole(size):
    # zstd keeps what it decoded past its output buffer once the input is used up: such a frame came back short
    p, u = Packer(), Unpacker()
    text = b"".join(b"%d %s\n" % (i, b"word " * (i % 7)) for i in range(size))[:size]
    for _ in range(3):
        wire = p.encode(text)
        assert len(wire) < size // 4 and u.decode(wire) == text


def _frame(packed: bytes, raw: int) -> bytes:
    return struct.pack(">II", len(packed), raw) + packed


@pytest.mark.parametrize("frame, why", [
    (_frame(b"x", 0), "a frame of 1 bytes for 0"),
    (_frame(b"", 10), "a frame of 0 bytes for 10"),
    (struct.pack(">II", 10, MAX_RAW + 1), "for 1048577"),
    (struct.pack(">II", 5000, 100), "a frame of 5000 bytes for 100"),
    (_frame(b"not zstd at all", 15), "corrupt"),
])
def test_hostile_frames_are_refused(frame, why):
    with pytest.raises(IntegrityError, match=why):
        Unpacker().decode(frame)


def test_a_small_frame_that_expands_past_its_size_is_stopped():
    z = zstandard.ZstdCompressor().compressobj()
    bomb = z.compress(b"\0" * (8 << 20)) + z.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    assert len(bomb) < 4096
    with pytest.raises(IntegrityError, match="beyond the 4096 bytes its frame says"):
        Unpacker().decode(_frame(bomb, 4096))


def test_a_frame_that_makes_less_than_it_says_is_refused():
    wire = Packer().encode(b"short")
    packed_len = struct.unpack(">I", wire[:4])[0]
    with pytest.raises(IntegrityError, match="made 5 bytes where it says 9"):
        Unpacker().decode(struct.pack(">II", packed_len, 9) + wire[8:])


def test_a_stream_cut_inside_a_frame_is_named_at_its_end():
    wire = Packer().encode(os.urandom(3000))
    u = Unpacker()
    assert u.decode(wire[:-10]) == b""
    with pytest.raises(IntegrityError, match="ended inside a frame"):
        u.finish()
