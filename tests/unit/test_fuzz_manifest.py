"""Fuzzing manifests and manifest parts: ``Manifest.from_bytes`` (a manifest file, or one a peer sent),
``Expectation.from_bytes`` / ``concat`` (push's manifest parts, hcp), ``manifest_from_parts`` (a
LOOKUP + READ-HASH reply) and the receiving calls' framing (capsule/exchange/receiving.py). Valid
inputs round-trip; hostile ones give ManifestError / ProtocolError (hashcache's Error), nothing else."""

from __future__ import annotations

import contextlib
import struct

import pytest
import zstandard
from hypothesis import example, given
from hypothesis import strategies as st

from capsule.exchange.receiving import MAX_MANIFEST_UPLOAD, decode_manifest_upload, split_blocks_upload
from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import Error, ManifestError
from hashcache.hcp import Expectation, ProtocolError, header_of, manifest_from_parts
from hashcache.manifest import ALGORITHM, KIND_FILE, KIND_LAYER, MAGIC, RECORD_SIZE, Manifest
from tests.helpers.fuzzing import MARKS, deep_json, fuzz, hostile, json_values, peak_allocation

pytestmark = MARKS

HASH = RECORD_SIZE - 8
digests = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    kind = draw(st.sampled_from([KIND_LAYER, KIND_FILE]))
    size = draw(st.integers(0, 64 * BLOCK_SIZE))
    nblocks = -(-size // BLOCK_SIZE)
    indices = sorted(draw(st.sets(st.integers(0, max(0, nblocks - 1)), max_size=min(nblocks, 24))))
    out = bytearray()
    for i in indices:
        zero = kind == KIND_LAYER and draw(st.booleans())
        out += ((i << 1) | zero).to_bytes(8, "little")
        out += bytes(HASH) if zero else draw(st.binary(min_size=HASH, max_size=HASH).filter(any))
    parent = draw(st.none() | digests) if kind == KIND_LAYER else None
    return Manifest(kind, ALGORITHM, BLOCK_SIZE, size, parent, bytes(out))


def _header(fields: bytes) -> bytes:
    return MAGIC + struct.pack("<I", len(fields)) + fields


# -- Manifest.from_bytes -----------------------------------------------------------------------------

@fuzz
@given(manifests())
def test_manifest_round_trips(m):
    back = Manifest.from_bytes(m.to_bytes())
    assert back == m and back.digest == m.digest
    assert list(back.records()) == list(m.records())


@fuzz
@given(hostile(manifests().map(Manifest.to_bytes), max_size=2048))
@example(_header(deep_json()))  # was RecursionError out of json.loads
@example(_header(b'{"algorithm":"blake3","block_size":4096,"count":0,"kind":"layer","parent":null,"size":'
                 + b"9" * 5000 + b',"digest":"x","format":1}'))  # int() of > 4300 digits
@example(_header(b'{"algorithm":"blake3","block_size":true,"count":0,"kind":"layer","parent":[1],'
                 b'"size":1e400,"digest":"x","format":1}'))
def test_hostile_manifest_bytes_give_manifest_error(data):
    try:
        m = Manifest.from_bytes(data)
    except ManifestError:
        return
    assert Manifest.from_bytes(m.to_bytes()) == m  # whatever parses is a valid manifest


def test_deeply_nested_manifest_header_is_a_manifest_error():
    """Regression: a header of 5000 nested arrays raised RecursionError, not ManifestError."""
    with pytest.raises(ManifestError, match="not valid JSON.*nested too deeply"):
        Manifest.from_bytes(_header(deep_json()))


def test_huge_record_count_allocates_nothing_big():
    fields = (b'{"algorithm":"blake3","block_size":4096,"count":1152921504606846975,"kind":"file",'
              b'"parent":null,"size":0,"digest":"x","format":1}')
    with pytest.raises(ManifestError, match="announces"):
        Manifest.from_bytes(_header(fields))
    assert peak_allocation(lambda: Manifest.from_bytes(_header(fields))) < 1 << 20


# -- manifest parts (push) and LOOKUP replies ---------------------------------------------------------

@st.composite
def parts_of(draw: st.DrawFn) -> tuple[Manifest, list[Expectation], int]:
    m = draw(manifests())
    hash_len = draw(st.sampled_from([8, HASH]))
    chunk = draw(st.integers(1, max(1, len(m))))
    parts = [Expectation.part_of(m, s, chunk, hash_len) for s in range(0, max(1, len(m)), chunk)]
    return m, parts, hash_len


@fuzz
@given(parts_of())
def test_manifest_parts_round_trip_and_concatenate(case):
    m, parts, hash_len = case
    back = [Expectation.from_bytes(p.to_bytes(), m.digest) for p in parts]
    whole = Expectation.concat(back)
    assert whole.header == {k: header_of(m)[k] for k in whole.header} and len(whole) == len(m)
    assert [(i, z, h) for i, z, h in whole.records()] == [(i, z, h[:hash_len]) for i, z, h in m.records()]
    full = Expectation.of_manifest(m)
    assert full.manifest_from(lambda i: m.hash_of(i)) == m


@fuzz
@given(hostile(parts_of().map(lambda c: c[1][0].to_bytes()), max_size=1024), digests)
@example(struct.pack("<II", 4000, 8) + deep_json(2000), "0" * 64)  # was RecursionError
@example(struct.pack("<II", 81, 8) + b'{"algorithm":"blake3","block_size":4096,"count":true,"kind":"layer",'
         b'"parent":null,"size":true}' + bytes(16), "0" * 64)  # booleans were taken for 1
def test_hostile_manifest_parts_give_protocol_errors(data, digest):
    try:
        e = Expectation.from_bytes(data, digest)
    except ProtocolError:
        return
    assert type(e.header["size"]) is int and type(e.header["count"]) is int
    assert all(k >> 1 < -(-e.header["size"] // BLOCK_SIZE) for k in e.keys)
    assert Expectation.from_bytes(e.to_bytes(), digest).to_bytes() == e.to_bytes()
    try:  # the parts a receiver folds together, and the manifest it rebuilds at commit
        Expectation.concat([e, e])
        e.manifest_from(lambda i: bytes(HASH))
    except Error:
        pass


def test_deeply_nested_part_header_is_a_protocol_error():
    """Regression: a part whose header is 2000 nested arrays raised RecursionError."""
    with pytest.raises(ProtocolError, match="nested too deeply"):
        Expectation.from_bytes(struct.pack("<II", 4000, 8) + deep_json(2000), "0" * 64)


@pytest.mark.parametrize(("size", "count", "says"), [("true", "true", "manifest size: True is not a whole number"),
                                                    ("4096", "true", "record count .*: True is not a whole number")])
def test_boolean_size_or_count_is_refused(size, count, says):
    """Regression: ``"size": true, "count": true`` passed as 1 (bool is an int in Python)."""
    head = (b'{"algorithm":"blake3","block_size":4096,"count":%s,"kind":"layer","parent":null,"size":%s}'
            % (count.encode(), size.encode()))
    with pytest.raises(ProtocolError, match=says):
        Expectation.from_bytes(struct.pack("<II", len(head), 8) + head + bytes(16), "0" * 64)


@fuzz
@given(st.dictionaries(st.sampled_from(["kind", "algorithm", "block_size", "size", "parent", "count", "x"]),
                       json_values), st.binary(max_size=200), digests)
def test_lookup_replies_of_any_shape_give_typed_errors(header, records, digest):
    try:
        m = manifest_from_parts(header, records, digest)
    except Error:
        return
    assert m.digest == digest  # only possible for a real manifest (it is not hit in practice)


# -- the receiving calls' framing ----------------------------------------------------------------------

@fuzz
@given(st.binary(max_size=300) | parts_of().map(lambda c: zstandard.ZstdCompressor().compress(c[1][0].to_bytes())))
def test_manifest_uploads_decompress_or_give_protocol_errors(raw):
    try:
        data = decode_manifest_upload(raw)
    except ProtocolError:
        return
    with contextlib.suppress(ProtocolError):
        Expectation.from_bytes(data, "0" * 64)


def test_a_zstd_bomb_manifest_upload_is_refused():
    # 20 KB that decompress to more than the limit (a frame without its content size: streamed)
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(MAX_MANIFEST_UPLOAD + BLOCK_SIZE))
    assert len(bomb) < 100_000
    with pytest.raises(ProtocolError, match="bad zstd manifest"):
        decode_manifest_upload(bomb)


@fuzz
@given(st.binary(max_size=64), st.binary(max_size=64), st.sampled_from([None, 0, 1, 2**31, 2**32 - 1]))
def test_block_uploads_split_or_give_protocol_errors(indices, blocks, n):
    raw = struct.pack("<I", len(indices) if n is None else n) + indices + blocks
    for data in (raw, raw[:3]):
        try:
            head, rest = split_blocks_upload(data)
        except ProtocolError:
            continue
        assert head + rest == data[4:] and len(head) == struct.unpack_from("<I", data)[0]
