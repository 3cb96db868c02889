"""HCP wire encodings and the receiving side, without a network."""

from __future__ import annotations

import os

import pytest
import zstandard

from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import ManifestMismatch
from hashcache.hcp import ProtocolError, Receiver, decode_indices, encode_indices, pack_blocks, unpack_blocks
from hashcache.manifest import manifest_of_file
from hashcache.shadow import Shadow

pytestmark = pytest.mark.unit


def test_indices_round_trip_and_limits():
    idx = [0, 1, 2, 100, 10_000, 1 << 30]
    assert decode_indices(encode_indices(idx), limit=(1 << 30) + 1) == idx
    assert len(encode_indices(list(range(1000)))) == 1000  # dense runs cost a byte each
    with pytest.raises(ProtocolError):
        decode_indices(encode_indices([5]), limit=5)
    with pytest.raises(ProtocolError):
        decode_indices(encode_indices(list(range(20))), limit=100, max_count=10)
    with pytest.raises(ProtocolError):
        decode_indices(b"\x80\x80", limit=100)
    with pytest.raises(ValueError):
        encode_indices([3, 3])


def test_unpack_refuses_wrong_sizes_and_bombs():
    blocks = [os.urandom(BLOCK_SIZE) for _ in range(3)]
    assert unpack_blocks(pack_blocks(blocks), 3) == blocks
    assert unpack_blocks(pack_blocks(blocks, compress=False), 3, compressed=False) == blocks
    with pytest.raises(ProtocolError):
        unpack_blocks(pack_blocks(blocks), 2)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    with pytest.raises(ProtocolError):
        unpack_blocks(bomb, 4)
    with pytest.raises(ProtocolError):
        unpack_blocks(b"not zstd", 1)


def _object(tmp_path, blocks):
    path = tmp_path / "obj"
    path.write_bytes(b"".join(blocks))
    return path, manifest_of_file(path)


def test_receiver_dedupes_verifies_and_resumes(tmp_path):
    a, b = os.urandom(BLOCK_SIZE), os.urandom(BLOCK_SIZE)
    blocks = [a, b, a, b"\0" * BLOCK_SIZE, a, os.urandom(BLOCK_SIZE)]
    path, m = _object(tmp_path, blocks)
    with Shadow(tmp_path / "shadow", m.block_count) as sh:
        r = Receiver(m, sh, "file x")
        need = r.plan()
        assert need == [0, 1, 5]  # one per distinct hash; the zero block never travels
        with pytest.raises(ManifestMismatch, match="block 1"):
            r.accept([0, 1], [a, a])
        assert sh.has(0) and sh.has(2) and sh.has(4)  # block 0 was right, and its repeats were copied
        assert not sh.has(1)
    # a new receiver over the same shadow resumes: only what is missing is asked for
    with Shadow(tmp_path / "shadow", m.block_count) as sh:
        r = Receiver(m, sh, "file x")
        assert r.plan() == [1, 5]
        assert r.stats.resumed_bytes == 3 * BLOCK_SIZE
        r.accept([1, 5], [b, blocks[5]])
        assert r.complete()
        assert all(sh.read(i) == blk for i, blk in enumerate(blocks))


def test_receiver_uses_the_cache_and_checks_it(tmp_path):
    blocks = [os.urandom(BLOCK_SIZE) for _ in range(4)]
    _path, m = _object(tmp_path, blocks)

    class Cache:
        def lookup(self, digest):
            for blk in blocks[:2]:
                from hashcache.blocks import hash_block

                if hash_block(blk) == digest:
                    return blk
            if digest == m.hash_of(2):
                return b"x" * BLOCK_SIZE  # a lying cache is not believed
            return None

    with Shadow(tmp_path / "s2", m.block_count) as sh:
        r = Receiver(m, sh, "file y", Cache())
        assert r.plan() == [2, 3]
        assert r.stats.cache_bytes == 2 * BLOCK_SIZE


def test_prefix_expectation_is_checked_by_the_digest(tmp_path):
    from hashcache.hcp import Expectation, compact_records, header_of

    blocks = [os.urandom(BLOCK_SIZE) for _ in range(5)]
    _path, m = _object(tmp_path, blocks)
    compact = compact_records(m, 0, len(m), 8)
    assert len(compact) == len(m) * 16
    exp = Expectation.from_bytes(Expectation.from_records(header_of(m), compact, m.digest, 8).to_bytes(), m.digest)
    with Shadow(tmp_path / "p", m.block_count) as sh:
        r = Receiver(exp, sh, "file z")
        need = r.plan()
        r.accept(need, [blocks[i] for i in need])
        assert r.finish() == m  # full hashes rebuilt from the data, digest matches
    # the same records under another object's name: the digest check refuses
    other = Expectation.from_records(header_of(m), compact, "0" * 64, 8)
    with Shadow(tmp_path / "q", m.block_count) as sh:
        r = Receiver(other, sh, "file w")
        need = r.plan()
        r.accept(need, [blocks[i] for i in need])
        with pytest.raises(ManifestMismatch, match="digest"):
            r.finish()
    # malformed uploads
    for bad in (b"", b"\x00" * 7, compact[:-1]):
        with pytest.raises(ProtocolError):
            Expectation.from_records(header_of(m), bad, m.digest, 8) if bad is compact[:-1] else \
                Expectation.from_bytes(bad, m.digest)
