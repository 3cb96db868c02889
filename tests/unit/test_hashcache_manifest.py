"""hashcache.manifest: building, digests, serialisation, corruption and verification."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from blake3 import blake3

import hashcache.manifest as manifest_mod
from hashcache.blocks import BLOCK_SIZE, NULL_HASH, hash_block
from hashcache.errors import HashcacheError, ManifestError, ManifestMismatch
from hashcache.manifest import (
    MAGIC,
    RECORD_SIZE,
    Manifest,
    manifest_of_file,
    verify_file,
    verify_layer,
)

pytestmark = pytest.mark.unit

B = BLOCK_SIZE
HAVE_QEMU = shutil.which("qemu-img") is not None and shutil.which("qemu-io") is not None
needs_qemu = pytest.mark.skipif(not HAVE_QEMU, reason="needs qemu-img and qemu-io")


def rec(index: int, digest: bytes | None) -> bytes:
    """One record: a data block with ``digest``, or a zero block if None."""
    if digest is None:
        return struct.pack("<Q", index << 1 | 1) + NULL_HASH
    return struct.pack("<Q", index << 1) + digest


def pattern(i: int) -> bytes:
    return (i.to_bytes(4, "little") + b"hashcache-test!!") * (B // 20) + b"\x01" * (B % 20)


# -- files -----------------------------------------------------------------------------------------


@pytest.fixture
def sparse_file(tmp_path: Path) -> Path:
    """Blocks 0, 1, 5 data; block 2 written zeros; 3-4 and 6..99 holes; 10 data; tail of 100 bytes."""
    path = tmp_path / "mem.img"
    with open(path, "wb") as f:
        f.truncate(100 * B + 100)
        for i in (0, 1, 5, 10):
            f.seek(i * B)
            f.write(pattern(i))
        f.seek(2 * B)
        f.write(bytes(B))
        f.seek(100 * B)
        f.write(b"\x42" * 100)
    return path


def test_file_manifest_lists_nonzero_blocks_only(sparse_file: Path) -> None:
    m = manifest_of_file(sparse_file)
    assert (m.kind, m.algorithm, m.block_size, m.size, m.parent) == ("file", "blake3", B, 100 * B + 100, None)
    assert list(m.indices()) == [0, 1, 5, 10, 100]
    assert len(m) == 5 and m.nonzero_blocks == 5 and m.zero_blocks == 0
    assert m.stored_bytes == 5 * B
    for i in (0, 1, 5, 10):
        assert m.hash_of(i) == blake3(pattern(i)).digest()
    # The last partial block is hashed zero-padded.
    assert m.hash_of(100) == blake3(b"\x42" * 100 + bytes(B - 100)).digest() == hash_block(b"\x42" * 100)
    assert m.hash_of(2) is None and m.hash_of(3) is None and m.hash_of(99) is None
    assert m.record(5) == (False, blake3(pattern(5)).digest())
    assert [r[0] for r in m.records()] == [0, 1, 5, 10, 100]
    assert all(not z for _, z, _ in m.records())


def test_file_holes_are_not_read(sparse_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = os.stat(sparse_file)
    # sparse files are what memory images are made of: the file system here must keep holes
    assert st.st_blocks * 512 < st.st_size, "the test directory's file system does not keep holes"
    read = 0
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        nonlocal read
        n = real(fd, buffers, offset)
        read += n
        return n

    monkeypatch.setattr(manifest_mod.os, "preadv", counting)
    m = manifest_of_file(sparse_file)
    assert read < 20 * B, f"read {read} bytes of a {st.st_size}-byte sparse file"
    assert list(m.indices()) == [0, 1, 5, 10, 100]


def test_file_large_chunks_and_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "CHUNK_SIZE", 64 * 1024)  # force many chunks
    path = tmp_path / "big.bin"
    data = bytearray(os.urandom(256 * B + 5))
    data[100 * B : 101 * B] = bytes(B)
    path.write_bytes(data)
    calls: list[tuple[int, int]] = []
    m = manifest_of_file(path, progress=lambda d, t: calls.append((d, t)))
    assert m.size == len(data)
    assert list(m.indices()) == [i for i in range(257) if i != 100]
    assert m.hash_of(256) == hash_block(data[256 * B :])
    assert m.hash_of(17) == hash_block(data[17 * B : 18 * B])
    assert len(calls) > 10
    assert calls[-1] == (len(data), len(data))
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    monkeypatch.undo()
    assert manifest_of_file(path).digest == m.digest  # chunk size does not change the result


def test_empty_and_all_zero_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    zeros = tmp_path / "zeros"
    zeros.write_bytes(bytes(10 * B))
    m0, mz = manifest_of_file(empty), manifest_of_file(zeros)
    assert len(m0) == len(mz) == 0
    assert m0.digest != mz.digest  # size is part of the identity


def test_not_a_regular_file(tmp_path: Path) -> None:
    with pytest.raises(HashcacheError, match="not a regular file"):
        manifest_of_file(tmp_path)


def test_digest_is_stable_and_sensitive(sparse_file: Path, tmp_path: Path) -> None:
    m1 = manifest_of_file(sparse_file)
    copy = tmp_path / "copy.img"
    copy.write_bytes(sparse_file.read_bytes())  # not sparse any more: same content, same digest
    assert manifest_of_file(sparse_file).digest == m1.digest == manifest_of_file(copy).digest
    assert len(m1.digest) == 64 and int(m1.digest, 16) >= 0
    with open(copy, "r+b") as f:
        f.seek(5 * B + 77)
        f.write(b"\xff")
    m2 = manifest_of_file(copy)
    assert m2.digest != m1.digest
    assert [i for i in range(101) if m1.hash_of(i) != m2.hash_of(i)] == [5]


def test_digest_definition() -> None:
    """The digest is BLAKE3(canonical header JSON + records): pin the exact bytes."""
    h = blake3(b"x" * B).digest()
    records = rec(0, h) + rec(3, None)
    m = Manifest("layer", "blake3", B, 4 * B, "ab" * 32, records)
    header = (
        b'{"algorithm":"blake3","block_size":4096,"count":2,"kind":"layer","parent":"' + b"ab" * 32 + b'",'
        b'"size":16384}'
    )
    assert m.canonical_header() == header
    assert m.digest == blake3(header + records).hexdigest()
    assert Manifest("layer", "blake3", B, 4 * B, None, records).digest != m.digest  # parent counts
    assert Manifest("layer", "blake3", B, 5 * B, "ab" * 32, records).digest != m.digest  # size counts


def test_record_accessors() -> None:
    hashes = {i: blake3(i.to_bytes(4, "little")).digest() for i in range(0, 3000, 3)}
    records = b"".join(rec(i, None if i % 2 else h) for i, h in hashes.items())
    m = Manifest("layer", "blake3", B, 3000 * B, None, records)
    assert len(m) == 1000
    assert m.zero_blocks == 500 and m.nonzero_blocks == 500 and m.stored_bytes == 500 * B
    assert m.record_range(10, 3) == records[10 * RECORD_SIZE : 13 * RECORD_SIZE]
    assert m.record_range(998, 10) == records[998 * RECORD_SIZE :]
    assert m.record_range(2000, 1) == b""
    with pytest.raises(ValueError):
        m.record_range(-1, 1)
    for i in range(3000):
        if i % 3:
            assert m.hash_of(i) is None
        elif i % 2:
            assert m.record(i) == (True, NULL_HASH)
        else:
            assert m.hash_of(i) == hashes[i]
    assert m.hash_of(10**9) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "disk"}, "kind"),
        ({"algorithm": "sha256"}, "algorithm"),
        ({"block_size": 1000}, "block size"),
        ({"size": -1}, "size"),
        ({"parent": "nothex"}, "parent"),
        ({"kind": "file", "parent": "00" * 32}, "cannot have a parent"),
        ({"record_bytes": rec(0, b"\1" * 32)[:-1]}, "multiple of 40"),
        ({"record_bytes": rec(2, b"\1" * 32) + rec(1, b"\2" * 32)}, "out of order"),
        ({"record_bytes": rec(1, b"\1" * 32) + rec(1, None)}, "out of order or repeated"),
        ({"record_bytes": rec(4, b"\1" * 32)}, "has only 4 blocks"),
        ({"record_bytes": struct.pack("<Q", 3) + b"\1" * 32}, "non-zero hash"),
        ({"kind": "file", "record_bytes": rec(1, None)}, "as zero"),
        ({"record_bytes": rec(1, blake3(bytes(B)).digest())}, "all zero"),
    ],
)
def test_constructor_validates(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "kind": "layer",
        "algorithm": "blake3",
        "block_size": B,
        "size": 4 * B,
        "parent": None,
        "record_bytes": b"",
    }
    args.update(kwargs)
    with pytest.raises(ManifestError, match=message):
        Manifest(**args)  # type: ignore[arg-type]


# -- serialisation ---------------------------------------------------------------------------------


def test_round_trip(sparse_file: Path, tmp_path: Path) -> None:
    m = manifest_of_file(sparse_file)
    assert Manifest.from_bytes(m.to_bytes()) == m
    path = tmp_path / "sub" / "m.manifest"
    path.parent.mkdir()
    m.write(path)
    back = Manifest.read(path)
    assert back == m and back.digest == m.digest
    assert os.listdir(path.parent) == ["m.manifest"]  # no temp file left behind
    other = Manifest("file", "blake3", B, 0, None, b"")
    other.write(path)  # atomic replace of an existing manifest
    assert Manifest.read(path) == other
    raw = path.read_bytes()
    assert raw.startswith(MAGIC)
    (hlen,) = struct.unpack_from("<I", raw, len(MAGIC))
    header = json.loads(raw[len(MAGIC) + 4 : len(MAGIC) + 4 + hlen])
    assert header["digest"] == other.digest and header["count"] == 0 and header["kind"] == "file"


@pytest.fixture
def written(sparse_file: Path, tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "x.manifest"
    manifest_of_file(sparse_file).write(path)
    return path, path.read_bytes()


def corrupt_variants(raw: bytes) -> dict[str, tuple[bytes, str]]:
    (hlen,) = struct.unpack_from("<I", raw, len(MAGIC))
    records_at = len(MAGIC) + 4 + hlen
    header = raw[len(MAGIC) + 4 : records_at]
    digest_at = raw.index(b'"digest":"') + len(b'"digest":"')

    def flip(data: bytes, at: int, new: bytes | None = None) -> bytes:
        b = bytearray(data)
        b[at] = new[0] if new else b[at] ^ 0x01
        return bytes(b)

    def with_header(h: dict[str, object]) -> bytes:
        hb = json.dumps(h).encode()
        return MAGIC + struct.pack("<I", len(hb)) + hb + raw[records_at:]

    h = json.loads(header)
    return {
        "truncated records": (raw[:-7], "truncated"),
        "truncated header": (raw[: len(MAGIC) + 10], "truncated inside the header"),
        "truncated length": (raw[: len(MAGIC) + 2], "truncated before"),
        "trailing data": (raw + b"\0", "trailing data"),
        "flipped hash byte": (flip(raw, records_at + 8 + 5), "does not match the recorded digest"),
        "flipped index byte": (flip(raw, records_at + RECORD_SIZE + 1), "out of order|does not match"),
        "flipped digest": (
            flip(raw, digest_at, b"0" if raw[digest_at : digest_at + 1] != b"0" else b"1"),
            "digest",
        ),
        "bad magic": (b"X" + raw[1:], "bad magic"),
        "bad json": (MAGIC + struct.pack("<I", 3) + b"{x}" + raw[records_at:], "not valid JSON"),
        "huge header": (MAGIC + struct.pack("<I", 1 << 30) + raw[len(MAGIC) + 4 :], "implausibly large"),
        "missing field": (with_header({k: v for k, v in h.items() if k != "size"}), "missing \\['size'\\]"),
        "wrong count": (with_header(h | {"count": h["count"] + 1}), "announces"),
        "bad count": (with_header(h | {"count": "5"}), "record count"),
        "future format": (with_header(h | {"format": 2}), "format 2"),
        "size too small": (with_header(h | {"size": 10}), "has only 1 blocks"),
    }


@pytest.mark.parametrize(
    "variant",
    [
        "truncated records",
        "truncated header",
        "truncated length",
        "trailing data",
        "flipped hash byte",
        "flipped index byte",
        "flipped digest",
        "bad magic",
        "bad json",
        "huge header",
        "missing field",
        "wrong count",
        "bad count",
        "future format",
        "size too small",
    ],
)
def test_corrupt_manifest_is_rejected(written: tuple[Path, bytes], variant: str) -> None:
    path, raw = written
    data, message = corrupt_variants(raw)[variant]
    path.write_bytes(data)
    with pytest.raises(ManifestError, match=message) as info:
        Manifest.read(path)
    assert str(path) in str(info.value)


def test_every_single_byte_flip_is_caught(written: tuple[Path, bytes]) -> None:
    path, raw = written
    for at in range(len(raw)):
        data = bytearray(raw)
        data[at] ^= 0x20
        with pytest.raises(ManifestError):
            Manifest.from_bytes(bytes(data), source="flip")


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read"):
        Manifest.read(tmp_path / "nope.manifest")


# -- verification ----------------------------------------------------------------------------------


def test_verify_file(sparse_file: Path, tmp_path: Path) -> None:
    m = manifest_of_file(sparse_file)
    verify_file(sparse_file, m, "mem")
    with open(sparse_file, "r+b") as f:
        f.seek(10 * B + 4000)
        f.write(b"\x00\x01")
    with pytest.raises(ManifestMismatch) as info:
        verify_file(sparse_file, m, "mem")
    assert (info.value.object_name, info.value.block) == ("mem", 10)
    assert str(info.value) == "file mem: block 10 does not match its manifest hash"


def test_verify_file_block_appears_or_vanishes(sparse_file: Path) -> None:
    m = manifest_of_file(sparse_file)
    with open(sparse_file, "r+b") as f:
        f.seek(50 * B)
        f.write(b"\x01")
    with pytest.raises(
        ManifestMismatch, match="block 50 holds data but its manifest says it is zero"
    ) as info:
        verify_file(sparse_file, m, "mem")
    assert info.value.block == 50
    with open(sparse_file, "r+b") as f:
        f.seek(50 * B)
        f.write(b"\x00")
        f.seek(1 * B)
        f.write(bytes(B))
    with pytest.raises(ManifestMismatch, match="block 1 is all zero but its manifest expects data"):
        verify_file(sparse_file, m, "mem")


def test_verify_file_size_mismatch(sparse_file: Path) -> None:
    m = manifest_of_file(sparse_file)
    with open(sparse_file, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ManifestMismatch, match="size is") as info:
        verify_file(sparse_file, m, "mem")
    assert info.value.block is None


def test_verify_wrong_kind(sparse_file: Path) -> None:
    m = manifest_of_file(sparse_file)
    with pytest.raises(ManifestMismatch, match="not a layer"):
        verify_layer(sparse_file, m, "mem")


# -- layers ----------------------------------------------------------------------------------------


