"""Fuzzing HCP request and reply bodies (hashcache/hcp.py and what the agent routes hand it): the
varint index lists of READ and of a block upload, the stream READ request and reply, READ payloads
(zstd), and a peer's JSON reply. Valid encodings round-trip; hostile ones give ProtocolError, and no
decoder returns more than it was told to accept."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import zstandard
from hypothesis import example, given
from hypothesis import strategies as st

from capsule.exchange.receiving import decode_manifest_upload
from hashcache.blocks import BLOCK_SIZE
from hashcache.hcp import (
    MAX_BATCH,
    STREAM_KINDS,
    ProtocolError,
    decode_indices,
    decode_stream_read,
    decode_stream_reply,
    encode_indices,
    encode_stream_error,
    encode_stream_read,
    pack_blocks,
    unpack_blocks,
)
from hashcache.transport.base import Reply
from tests.helpers.fuzzing import MARKS, deep_json, fuzz, hostile, peak_allocation

pytestmark = MARKS

# a 4 KiB block: random (incompressible) or one byte repeated; built from a seed (drawing 4096 bytes is slow)
blocks = st.one_of(st.integers(0, 2**32).map(lambda seed: random.Random(seed).randbytes(BLOCK_SIZE)),
                   st.integers(0, 255).map(lambda b: bytes([b]) * BLOCK_SIZE))
index_lists = st.sets(st.integers(0, 2**40), max_size=64).map(sorted)


@fuzz
@given(index_lists)
def test_indices_round_trip(indices):
    assert decode_indices(encode_indices(indices), limit=2**40 + 1) == indices


@fuzz
@given(hostile(index_lists.map(encode_indices)), st.integers(0, 2**41), st.integers(0, MAX_BATCH))
@example(b"\xff" * 9 + b"\x7f", 10, MAX_BATCH)  # a 64-bit delta
@example(b"\x80" * 20, 10, MAX_BATCH)  # a varint that never ends
@example(bytes(MAX_BATCH + 1), 2**20, MAX_BATCH)  # one index too many
def test_hostile_index_lists_give_protocol_errors(data, limit, max_count):
    try:
        out = decode_indices(data, limit, max_count)
    except ProtocolError:
        return
    assert len(out) <= max_count and all(0 <= i < limit for i in out)
    assert out == sorted(set(out)) and decode_indices(encode_indices(out), limit, max_count) == out


def test_a_huge_index_list_is_refused_after_max_count():
    data = bytes(10_000_000)  # ten million zero deltas: indices 0, 1, 2, ...
    assert peak_allocation(lambda: decode_indices(data, 2**40)) < 1 << 20


@fuzz
@given(st.sampled_from(STREAM_KINDS), st.binary(min_size=32, max_size=32).map(bytes.hex), index_lists,
       st.integers(0, 19))
def test_stream_reads_round_trip(kind, oid, indices, level):
    k, o, lvl, raw = decode_stream_read(encode_stream_read(kind, oid, indices, level))
    assert (k, o, lvl, decode_indices(raw, 2**41)) == (kind, oid, level, indices)


@fuzz
@given(hostile(st.builds(encode_stream_read, st.sampled_from(STREAM_KINDS),
                         st.binary(min_size=32, max_size=32).map(bytes.hex), index_lists, st.integers(0, 19))))
def test_hostile_stream_reads_give_protocol_errors(msg):
    try:
        kind, oid, level, raw = decode_stream_read(msg)
    except ProtocolError:
        return
    assert kind in STREAM_KINDS and len(oid) == 64 and 0 <= level <= 19


@fuzz
@given(hostile(st.builds(encode_stream_error, st.text(max_size=40), st.text(max_size=20), st.integers(100, 599))
               | st.binary(max_size=64).map(lambda b: b"\x00" + b)))
@example(b"\x01" + deep_json())  # was RecursionError
def test_hostile_stream_replies_give_protocol_errors(msg):
    try:
        payload, err = decode_stream_reply(msg)
    except ProtocolError:
        return
    assert (payload is None) == bool(err) or (payload is None and isinstance(err, dict))


@fuzz
@given(st.lists(blocks, max_size=4), st.booleans())
def test_read_payloads_round_trip(blocks, compress):
    assert unpack_blocks(pack_blocks(blocks, compress=compress), len(blocks), compress) == blocks


@fuzz
@given(hostile(st.lists(blocks, max_size=2).map(pack_blocks)),
       st.integers(0, 4), st.booleans())
@example(b"(\xb5/\xfd\xc0\x00\x00\x00\x00\x00\x00\x00\x00\x01", 0, True)  # was MemoryError
def test_hostile_read_payloads_give_protocol_errors(payload, count, compressed):
    try:
        blocks = unpack_blocks(payload, count, compressed)
    except ProtocolError:
        return
    assert len(blocks) == count and all(len(b) == BLOCK_SIZE for b in blocks)


@pytest.mark.parametrize("declared", [1 << 56, 1 << 30, 5 * BLOCK_SIZE])
def test_a_frame_declaring_more_than_expected_is_refused_from_its_header(declared):
    """Regression: a 14-byte READ payload declaring 2^56 bytes raised MemoryError (1 GiB: allocated)."""
    frame = b"(\xb5/\xfd\xc0\x00" + declared.to_bytes(8, "little")  # magic, 8-byte size, window, size
    with pytest.raises(ProtocolError, match=f"declares {declared} bytes, more than the {4 * BLOCK_SIZE}"):
        unpack_blocks(frame, 4)
    assert peak_allocation(lambda: unpack_blocks(frame, 4)) < 1 << 20
    with pytest.raises(ProtocolError, match="bad zstd manifest: it declares"):
        decode_manifest_upload(b"(\xb5/\xfd\xc0\x00" + (1 << 40).to_bytes(8, "little"))


def test_a_zstd_bomb_read_payload_is_refused_within_its_count():
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(256 << 20))
    try:
        unpack_blocks(bomb, 2)
    except ProtocolError:
        pass
    else:
        raise AssertionError("a payload of 256 MiB was taken for 2 blocks")
    assert peak_allocation(lambda: unpack_blocks(bomb, 2)) < 1 << 20


@fuzz
@given(st.binary(max_size=200) | st.just(deep_json()) | st.builds(lambda v: json.dumps(v).encode(), st.integers()))
def test_a_peers_json_reply_parses_or_gives_a_protocol_error(content):
    with contextlib.suppress(ProtocolError):
        Reply(status=200, content=content, headers={}).json()
