"""Block uploads as one zstd or xz stream per object (capsule/exchange/streams.py): segments taken in
order, a retried one answered once, a gap or an unknown stream refused as lost, a bad segment (or one in
another codec, or an xz stream asking for a larger dictionary) dropping the stream; the sender's choice
of codec (pushes between two real agents: tests/tools/test_object_streams.py)."""

from __future__ import annotations

import lzma
import random

import pytest

from capsule import transfer
from capsule.exchange.streams import ObjectStreamLost, Streams
from capsule.transfer import codecpick, pushing
from hashcache import native
from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import ManifestMismatch
from hashcache.hcp import ProtocolError

KEY = ("layer", "ab" * 32)


def _segments(n: int, per: int = 4, seed: int = 1, codec: str = "zstd") -> list[tuple[list[bytes], bytes]]:
    rng = random.Random(seed)
    enc = native.XzStreamEncoder() if codec == "xz" else native.StreamEncoder(19)
    out = []
    for _ in range(n):
        blocks = [rng.randbytes(BLOCK_SIZE) for _ in range(per)]
        out.append((blocks, enc.segment(b"".join(blocks))))
    return out


@pytest.mark.unit
@pytest.mark.parametrize("codec", ["zstd", "xz"])
def test_segments_are_taken_in_order_and_a_retried_one_once(codec):
    streams, kept = Streams(), []
    segs = _segments(3, codec=codec)
    for seq, (blocks, payload) in enumerate(segs):
        assert streams.take(KEY, "s1", seq, len(blocks), payload, kept.append, codec)
        assert streams.position(KEY, "s1") == seq + 1
    assert kept == [blocks for blocks, _ in segs]
    assert not streams.take(KEY, "s1", 1, 4, segs[1][1], kept.append, codec)  # a retry: answered, not kept again
    assert len(kept) == 3
    assert streams.position(KEY, "other") is None


@pytest.mark.unit
def test_a_gap_or_an_unknown_stream_is_lost_and_a_new_stream_starts_at_zero():
    streams, kept = Streams(), []
    segs = _segments(3)
    with pytest.raises(ObjectStreamLost, match="not open here"):
        streams.take(KEY, "s1", 1, 4, segs[1][1], kept.append)
    streams.take(KEY, "s1", 0, 4, segs[0][1], kept.append)
    with pytest.raises(ObjectStreamLost, match="came before segment 1"):
        streams.take(KEY, "s1", 2, 4, segs[2][1], kept.append)
    fresh = _segments(1, seed=2)[0]
    assert streams.take(KEY, "s2", 0, 4, fresh[1], kept.append)  # a new stream replaces the old one
    assert streams.position(KEY, "s1") is None and streams.position(KEY, "s2") == 1
    with pytest.raises(ProtocolError):
        streams.take(KEY, "bad id!", 0, 4, fresh[1], kept.append)


@pytest.mark.unit
def test_a_bad_segment_or_refused_blocks_drop_the_stream():
    segs = _segments(3)
    for bad in (b"not zstd at all", segs[1][1][:-3]):
        streams, kept = Streams(), []
        streams.take(KEY, "s1", 0, 4, segs[0][1], kept.append)
        with pytest.raises(ProtocolError, match="segment 1"):
            streams.take(KEY, "s1", 1, 4, bad, kept.append)
        assert streams.position(KEY, "s1") is None and len(kept) == 1
    streams = Streams()
    with pytest.raises(ProtocolError, match="more than"):  # more blocks in it than announced
        streams.take(KEY, "s1", 0, 3, segs[0][1], lambda b: None)

    def refuse(blocks: list[bytes]) -> None:
        raise ManifestMismatch("block 7 does not match", object_name="x", block=7)

    streams = Streams()
    with pytest.raises(ManifestMismatch):
        streams.take(KEY, "s1", 0, 4, segs[0][1], refuse)
    assert streams.position(KEY, "s1") is None


@pytest.mark.unit
def test_a_segment_in_another_or_an_unknown_codec_or_a_larger_xz_dictionary_is_refused():
    xz, zs = _segments(2, codec="xz"), _segments(2)
    streams, kept = Streams(), []
    streams.take(KEY, "s1", 0, 4, xz[0][1], kept.append, "xz")
    with pytest.raises(ProtocolError, match="xz object stream s1 says it is zstd"):
        streams.take(KEY, "s1", 1, 4, zs[1][1], kept.append, "zstd")
    assert streams.position(KEY, "s1") is None and len(kept) == 1
    with pytest.raises(ProtocolError, match="unknown codec 'lz4'"):
        streams.take(KEY, "s2", 0, 4, zs[0][1], kept.append, "lz4")
    # an xz stream whose dictionary (64 MiB) is over the 8 MiB both ends use: refused, not allocated
    raw = random.Random(3).randbytes(4 * BLOCK_SIZE)
    big = lzma.compress(raw, format=lzma.FORMAT_XZ, check=lzma.CHECK_NONE,
                        filters=[{"id": lzma.FILTER_LZMA2, "preset": 6, "dict_size": 64 << 20}])
    with pytest.raises(ProtocolError, match="segment 0"):
        streams.take(KEY, "s3", 0, 4, big, kept.append, "xz")
    ok = lzma.compress(raw, format=lzma.FORMAT_XZ, check=lzma.CHECK_NONE,
                       filters=[{"id": lzma.FILTER_LZMA2, "preset": 6, "dict_size": 8 << 20}])
    assert native.XzStreamDecoder().segment(ok, len(raw)) == raw   # the same stream with 8 MiB is taken


@pytest.mark.unit
def test_the_sender_picks_xz_where_asked_and_taken_else_zstd_streams_from_the_stream_level():
    def pick(opts: transfer.Options, offered: set[str]) -> tuple[object, str]:
        allowed = codecpick.candidates(offered, pushing.STREAM_LEVEL)
        codec = opts.picker(pushing.STREAM_LEVEL).choose(allowed)
        return pushing._stream_encoder(codec, allowed), codec.name

    assert pick(transfer.Options(xz=True), {"zstd", "xz"})[1] == "xz"
    assert pick(transfer.Options(xz=True, level=19), {"1"})[1] == "zstd"   # an older receiver: zstd streams
    assert pick(transfer.Options(xz=True, level=19), {"1"})[0] is not None
    assert pick(transfer.Options(xz=True), {"zstd"})[0] is None            # no xz there, level 3: frames
    assert pick(transfer.Options(level=19), {"zstd", "xz"})[1] == "zstd"
    assert pick(transfer.Options(level=19), set())[0] is None               # no streams at all: frames
