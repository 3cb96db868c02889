"""hashcache.qcow2_writer: layers written from manifests, checked by real qemu-img / qemu-io."""

from __future__ import annotations

import json
import random
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from hashcache.blocks import ALGORITHM, BLOCK_SIZE, NULL_HASH, hash_block
from hashcache.manifest import KIND_LAYER, Manifest, manifest_of_layer
from hashcache.qcow2 import Qcow2Image
from hashcache.qcow2_writer import (
    CLUSTER_SIZE,
    REFCOUNTS_PER_BLOCK,
    REFTABLE_ENTRIES_PER_CLUSTER,
    refcount_layout,
    write_layer,
)

pytestmark = [
    pytest.mark.tools,
    pytest.mark.skipif(
        shutil.which("qemu-img") is None or shutil.which("qemu-io") is None,
        reason="needs qemu-img and qemu-io",
    ),
]

B = BLOCK_SIZE
PER_CLUSTER = CLUSTER_SIZE // B  # 32 blocks (subclusters) per cluster
OPTS = "cluster_size=131072,extended_l2=on"
PARENT = "5e" * 32
# 6 MiB + 12.5 KiB: the last cluster is partly used and the last block is a short one.
SIZE = 6 * 1024 * 1024 + 12 * 1024 + 512
NBLOCKS = -(-SIZE // B)

#: A layer's content: block index -> its 4 KiB of data, or None for a zero-flagged block.
Spec = dict[int, bytes | None]


# -- helpers -----------------------------------------------------------------------------------------


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True)


def qemu_io(path: Path, *commands: str, fmt: str = "qcow2") -> str:
    args: list[str | Path] = ["qemu-io", "-f", fmt]
    for c in commands:
        args += ["-c", c]
    out = run(*args, path)
    text = out.stdout + out.stderr
    assert "error" not in text.lower() and "pattern verification failed" not in text.lower(), text
    return text


def assert_clean(path: Path) -> dict[str, object]:
    """qemu-img check: no errors, corruptions or leaks."""
    proc = subprocess.run(
        ["qemu-img", "check", "--output=json", str(path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["check-errors"] == 0, report
    assert report.get("corruptions", 0) == 0, report
    assert report.get("leaks", 0) == 0, report
    assert report.get("corruptions-fixed", 0) == 0 and report.get("leaks-fixed", 0) == 0, report
    return report


def chain_raw(path: Path) -> bytes:
    out = path.with_suffix(".chain.raw")
    run("qemu-img", "convert", "-O", "raw", path, out)
    data = out.read_bytes()
    out.unlink()
    return data


def records_of(spec: Spec) -> list[tuple[int, bool]]:
    return [(i, spec[i] is None) for i in sorted(spec)]


def expected_manifest(size: int, parent: str | None, spec: Spec) -> Manifest:
    parts = []
    for i in sorted(spec):
        data = spec[i]
        parts.append(struct.pack("<Q", i << 1 | (data is None)))
        parts.append(NULL_HASH if data is None else hash_block(data))
    return Manifest(KIND_LAYER, ALGORITHM, B, size, parent, b"".join(parts))


def write(out: Path, spec: Spec, *, size: int = SIZE, backing: str | None = None) -> list[int]:
    """write_layer from ``spec``; returns the blocks read_block was asked for, in call order."""
    calls: list[int] = []

    def read_block(i: int) -> bytes:
        calls.append(i)
        data = spec[i]
        assert data is not None, f"read_block called for zero block {i}"
        return data

    write_layer(out, virtual_size=size, backing=backing, records=records_of(spec), read_block=read_block)
    return calls


def expected_chain(size: int, under: bytes, spec: Spec) -> bytes:
    """Guest view: ``under`` (the backing chain) overridden by the layer's blocks."""
    buf = bytearray(under.ljust(size, b"\0"))
    for i, data in spec.items():
        start = i * B
        end = min(start + B, size)
        buf[start:end] = bytes(end - start) if data is None else data[: end - start]
    return bytes(buf)


def block(rng: random.Random) -> bytes:
    return rng.randbytes(B)


def last_block(rng: random.Random) -> bytes:
    """The short last block of a SIZE-byte disk, zero-padded to 4 KiB as the manifest hashes it."""
    tail = SIZE % B
    return rng.randbytes(tail) + bytes(B - tail)


def random_spec(rng: random.Random) -> Spec:
    """Every kind of cluster: full of data, only zeros, mixed, sparse, plus the very last block."""
    spec: Spec = {}
    for c in range(-(-NBLOCKS // PER_CLUSTER)):
        first = c * PER_CLUSTER
        indices = range(first, min(first + PER_CLUSTER, NBLOCKS))
        shape = rng.choice(["skip", "skip", "data", "zero", "mixed", "sparse", "zero-sparse"])
        for i in indices:
            if shape == "data":
                spec[i] = block(rng)
            elif shape == "zero":
                spec[i] = None
            elif shape == "mixed":
                r = rng.random()
                if r < 0.4:
                    spec[i] = block(rng)
                elif r < 0.7:
                    spec[i] = None
            elif shape == "sparse" and rng.random() < 0.1:
                spec[i] = block(rng)
            elif shape == "zero-sparse" and rng.random() < 0.2:
                spec[i] = None
    spec[NBLOCKS - 1] = last_block(rng)
    spec[0] = block(rng)
    return spec


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """A QEMU-made root layer (``base.qcow2``) of SIZE bytes with recognisable data, and its content."""
    d = tmp_path_factory.mktemp("qcow2w")
    content = bytearray(random.Random(7).randbytes(SIZE))
    content[B * 100 : B * 300] = bytes(B * 200)  # left unallocated by qemu-img convert
    raw = d / "base.raw"
    raw.write_bytes(content)
    path = d / "base.qcow2"
    run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", "-o", OPTS, raw, path)
    return path, bytes(content)


def layer_dir(base: tuple[Path, bytes], tmp_path: Path) -> Path:
    """A fresh directory holding a copy of the base, so relative backing names resolve."""
    shutil.copy(base[0], tmp_path / "base.qcow2")
    return tmp_path


# -- layers over a backing file ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_layer_over_backing(base: tuple[Path, bytes], tmp_path: Path, seed: int) -> None:
    d = layer_dir(base, tmp_path)
    spec = random_spec(random.Random(seed))
    out = d / "layer.qcow2"
    calls = write(out, spec, backing="base.qcow2")

    assert calls == sorted(i for i, v in spec.items() if v is not None)
    assert_clean(out)
    assert manifest_of_layer(out, PARENT).digest == expected_manifest(SIZE, PARENT, spec).digest
    assert chain_raw(out) == expected_chain(SIZE, base[1], spec)
    with Qcow2Image(out) as img:
        assert img.backing_file == "base.qcow2"
        assert img.backing_format == "qcow2"
        assert img.version == 3 and img.extended_l2 and img.cluster_size == CLUSTER_SIZE
        assert img.compression_type == 0 and not img.dirty


def test_header_as_qemu_sees_it(base: tuple[Path, bytes], tmp_path: Path) -> None:
    d = layer_dir(base, tmp_path)
    out = d / "layer.qcow2"
    write(out, {3: b"\x01" * B, 4: None}, backing="base.qcow2")
    info = json.loads(run("qemu-img", "info", "--output=json", out).stdout)
    assert info["format"] == "qcow2"
    assert info["virtual-size"] == SIZE
    assert info["cluster-size"] == CLUSTER_SIZE
    assert info["backing-filename"] == "base.qcow2"
    assert info["backing-filename-format"] == "qcow2"
    data = info["format-specific"]["data"]
    assert data["compat"] == "1.1"
    assert data["extended-l2"] is True
    assert data["refcount-bits"] == 16
    assert data["compression-type"] == "zlib"
    assert data["corrupt"] is False and data["lazy-refcounts"] is False
    raw = out.read_bytes()
    (incompat, compat, autoclear, refcount_order, header_length) = struct.unpack_from(">QQQII", raw, 72)
    assert (incompat, compat, autoclear, refcount_order, header_length) == (1 << 4, 0, 0, 4, 112)
    assert raw[104:112] == bytes(8)


def test_zero_only_clusters_use_no_host_cluster(base: tuple[Path, bytes], tmp_path: Path) -> None:
    d = layer_dir(base, tmp_path)
    out = d / "layer.qcow2"
    spec: Spec = {i: None for i in range(PER_CLUSTER * 2, PER_CLUSTER * 3)}  # a whole zero cluster
    spec.update({i: None for i in (5, 9, 31)})  # zero subclusters in a cluster without data
    write(out, spec, backing="base.qcow2")
    report = assert_clean(out)
    assert report.get("allocated-clusters", 0) == 0  # no data cluster at all
    assert manifest_of_layer(out, PARENT).digest == expected_manifest(SIZE, PARENT, spec).digest
    assert chain_raw(out) == expected_chain(SIZE, base[1], spec)


def test_empty_layer(base: tuple[Path, bytes], tmp_path: Path) -> None:
    d = layer_dir(base, tmp_path)
    out = d / "layer.qcow2"
    assert write(out, {}, backing="base.qcow2") == []
    assert_clean(out)
    m = manifest_of_layer(out, PARENT)
    assert len(m) == 0 and m.digest == expected_manifest(SIZE, PARENT, {}).digest
    assert chain_raw(out) == base[1]


def test_qemu_can_write_an_overlay_on_top(base: tuple[Path, bytes], tmp_path: Path) -> None:
    d = layer_dir(base, tmp_path)
    spec = random_spec(random.Random(11))
    out = d / "layer.qcow2"
    write(out, spec, backing="base.qcow2")
    top = d / "top.qcow2"
    run("qemu-img", "create", "-f", "qcow2", "-o", OPTS, "-b", "layer.qcow2", "-F", "qcow2", top)
    qemu_io(top, "write -P 0x5a 0 64k", "write -P 0x33 1M 200k")
    qemu_io(top, "read -P 0x5a 0 64k", "read -P 0x33 1M 200k")
    assert_clean(top)
    assert_clean(out)
    want = bytearray(expected_chain(SIZE, base[1], spec))
    want[0 : 64 * 1024] = b"\x5a" * (64 * 1024)
    want[1024 * 1024 : 1024 * 1024 + 200 * 1024] = b"\x33" * (200 * 1024)
    assert chain_raw(top) == bytes(want)
    # The written layer is untouched by writes to its overlay.
    assert manifest_of_layer(out, PARENT).digest == expected_manifest(SIZE, PARENT, spec).digest


def test_qemu_can_write_into_the_layer_itself(base: tuple[Path, bytes], tmp_path: Path) -> None:
    """QEMU's allocator trusts our refcounts: writes into the layer leave it clean and correct."""
    d = layer_dir(base, tmp_path)
    spec = random_spec(random.Random(12))
    out = d / "layer.qcow2"
    write(out, spec, backing="base.qcow2")
    qemu_io(out, "write -P 0x77 8k 300k", "write -z 2M 128k", "write -P 0x78 5M 4k")
    assert_clean(out)
    want = bytearray(expected_chain(SIZE, base[1], spec))
    want[8 * 1024 : 308 * 1024] = b"\x77" * (300 * 1024)
    want[2 * 1024 * 1024 : 2 * 1024 * 1024 + CLUSTER_SIZE] = bytes(CLUSTER_SIZE)
    want[5 * 1024 * 1024 : 5 * 1024 * 1024 + B] = b"\x78" * B
    assert chain_raw(out) == bytes(want)


# -- root layers -------------------------------------------------------------------------------------


def test_root_layer(tmp_path: Path) -> None:
    spec = random_spec(random.Random(21))
    out = tmp_path / "root.qcow2"
    write(out, spec, backing=None)
    assert_clean(out)
    with Qcow2Image(out) as img:
        assert img.backing_file is None and img.backing_format is None
    info = json.loads(run("qemu-img", "info", "--output=json", out).stdout)
    assert "backing-filename" not in info
    assert manifest_of_layer(out, None).digest == expected_manifest(SIZE, None, spec).digest
    assert chain_raw(out) == expected_chain(SIZE, b"", spec)


def test_empty_root_layer_and_zero_size(tmp_path: Path) -> None:
    out = tmp_path / "empty.qcow2"
    write(out, {}, size=SIZE)
    assert_clean(out)
    assert chain_raw(out) == bytes(SIZE)
    assert manifest_of_layer(out, None).digest == expected_manifest(SIZE, None, {}).digest

    nothing = tmp_path / "nothing.qcow2"
    write(nothing, {}, size=0)
    assert_clean(nothing)
    assert manifest_of_layer(nothing, None).digest == expected_manifest(0, None, {}).digest
    assert json.loads(run("qemu-img", "info", "--output=json", nothing).stdout)["virtual-size"] == 0


def test_two_gib_spans_several_l2_tables(tmp_path: Path) -> None:
    size = 2 * 1024**3 + 3 * CLUSTER_SIZE  # three L1 entries, the last one barely used
    rng = random.Random(31)
    gib = 1024**3 // B
    spec: Spec = {
        0: block(rng),
        1: None,
        gib - 1: block(rng),  # last block of the first L2 table
        gib: block(rng),  # first block of the second
        gib + 40: None,
        gib + PER_CLUSTER * 100 + 7: block(rng),
        2 * gib + 2 * PER_CLUSTER: None,
        size // B - 1: block(rng),  # the very last block
    }
    out = tmp_path / "big.qcow2"
    write(out, spec, size=size)
    report = assert_clean(out)
    assert report["allocated-clusters"] == 5
    assert manifest_of_layer(out, None).digest == expected_manifest(size, None, spec).digest
    commands = [
        f"read -P {data[0]} {i * B} {B}" if data is not None and len(set(data)) == 1 else f"read {i * B} {B}"
        for i, data in spec.items()
    ]
    qemu_io(out, *commands, "read -P 0 8k 1M", f"read -P 0 {(gib + 41) * B} 64k")
    # Compare content block by block through QEMU (a raw dump of 2 GiB would be slow).
    raw = tmp_path / "big.raw"
    run("qemu-img", "convert", "-O", "raw", out, raw)
    with raw.open("rb") as f:
        assert f.seek(0, 2) == size
        for i, data in spec.items():
            f.seek(i * B)
            assert f.read(B) == (bytes(B) if data is None else data), i


# -- round trip through a layer QEMU wrote -----------------------------------------------------------


def rewrite(src: Path, out: Path, *, backing: str | None, parent: str | None) -> Manifest:
    """Rewrite ``src`` with write_layer from its own manifest, reading blocks through Qcow2Image."""
    source = manifest_of_layer(src, parent)
    with Qcow2Image(src) as img:

        def read_block(i: int) -> bytes:
            data = img.read_block(i)
            assert data is not None
            return data

        write_layer(
            out,
            virtual_size=img.virtual_size,
            backing=backing,
            records=((i, z) for i, z, _ in source.records()),
            read_block=read_block,
        )
    return source


def test_round_trip_of_a_qemu_written_layer(base: tuple[Path, bytes], tmp_path: Path) -> None:
    d = layer_dir(base, tmp_path)
    src = d / "qemu.qcow2"
    run("qemu-img", "create", "-f", "qcow2", "-o", OPTS, "-b", "base.qcow2", "-F", "qcow2", src)
    qemu_io(
        src,
        "write -P 0xab 4k 4k",
        "write -z 1M 64k",
        "write -P 0xcd 2M 200k",  # across a cluster boundary
        "write -P 0 3M 4k",  # data that reads as zero: the manifest flags it zero
        "write -z 4M 128k",  # a whole zero cluster
        "write -P 0x11 4352k 4k",
        "write -z -u 4356k 8k",
        f"write -P 0xee {SIZE - 512} 512",  # the short last block
    )
    source = manifest_of_layer(src, PARENT)
    assert source.zero_blocks and source.nonzero_blocks

    out = d / "rewritten.qcow2"
    rewrite(src, out, backing="base.qcow2", parent=PARENT)
    assert_clean(out)
    assert manifest_of_layer(out, PARENT).digest == source.digest
    assert chain_raw(out) == chain_raw(src)


def test_round_trip_of_a_qemu_root_layer(base: tuple[Path, bytes], tmp_path: Path) -> None:
    out = tmp_path / "root.qcow2"
    source = rewrite(base[0], out, backing=None, parent=None)
    assert len(source) and not source.zero_blocks
    assert_clean(out)
    assert manifest_of_layer(out, None).digest == source.digest
    assert chain_raw(out) == base[1]


# -- refcount structures -----------------------------------------------------------------------------


@pytest.mark.parametrize("used", [1, 5, REFCOUNTS_PER_BLOCK - 3, REFCOUNTS_PER_BLOCK - 1, REFCOUNTS_PER_BLOCK,
                                  REFCOUNTS_PER_BLOCK * 7 + 11, REFCOUNTS_PER_BLOCK * REFTABLE_ENTRIES_PER_CLUSTER,
                                  3 * REFCOUNTS_PER_BLOCK * REFTABLE_ENTRIES_PER_CLUSTER - 2])  # fmt: skip
def test_refcount_layout_covers_itself(used: int) -> None:
    table, blocks = refcount_layout(used)
    total = used + table + blocks
    assert blocks * REFCOUNTS_PER_BLOCK >= total  # every cluster, the structures included, has a refcount
    assert (blocks - 1) * REFCOUNTS_PER_BLOCK < total  # and no refcount block is superfluous
    assert table * REFTABLE_ENTRIES_PER_CLUSTER >= blocks
    assert table == 1 or (table - 1) * REFTABLE_ENTRIES_PER_CLUSTER < blocks


def test_more_clusters_than_one_refcount_block_covers(tmp_path: Path) -> None:
    """> 65536 host clusters (8 GiB of sparse file): a second refcount block is needed."""
    nclusters = REFCOUNTS_PER_BLOCK + 10
    size = nclusters * CLUSTER_SIZE
    payload = b"\x42" * B
    spec: Spec = {c * PER_CLUSTER + c % PER_CLUSTER: payload for c in range(nclusters)}
    spec[3] = None
    out = tmp_path / "many.qcow2"
    write(out, spec, size=size)
    report = assert_clean(out)
    assert report["allocated-clusters"] == nclusters
    assert manifest_of_layer(out, None).digest == expected_manifest(size, None, spec).digest
    last = nclusters - 1
    qemu_io(out, f"read -P 0 {3 * B} 4k", f"read -P 0x42 {(last * PER_CLUSTER + last % PER_CLUSTER) * B} 4k")


# -- progress and refusals ---------------------------------------------------------------------------


def test_progress_reports_guest_bytes(tmp_path: Path) -> None:
    spec = random_spec(random.Random(41))
    seen: list[tuple[int, int]] = []
    write_layer(
        tmp_path / "p.qcow2",
        virtual_size=SIZE,
        backing=None,
        records=records_of(spec),
        read_block=lambda i: spec[i] or b"",
        progress=lambda done, total: seen.append((done, total)),
    )
    assert seen and seen[-1] == (SIZE, SIZE)
    assert all(total == SIZE for _, total in seen)
    dones = [done for done, _ in seen]
    assert dones == sorted(dones)


def test_read_block_buffer_may_be_reused(tmp_path: Path) -> None:
    buf = bytearray(B)
    spec: Spec = {i: bytes([i + 1]) * B for i in range(0, 40, 3)}

    def read_block(i: int) -> bytes:
        data = spec[i]
        assert data is not None
        buf[:] = data
        return buf  # type: ignore[return-value]  # a reused buffer, as a streaming caller would pass

    out = tmp_path / "reuse.qcow2"
    write_layer(out, virtual_size=SIZE, backing=None, records=records_of(spec), read_block=read_block)
    assert manifest_of_layer(out, None).digest == expected_manifest(SIZE, None, spec).digest


def test_bytes_past_the_end_of_the_disk_are_stored_as_zero(tmp_path: Path) -> None:
    rng = random.Random(51)
    padded = last_block(rng)
    tail = SIZE % B
    garbage = padded[:tail] + b"\xff" * (B - tail)
    out = tmp_path / "tail.qcow2"
    write_layer(out, virtual_size=SIZE, backing=None, records=[(NBLOCKS - 1, False)], read_block=lambda i: garbage)
    assert_clean(out)
    assert manifest_of_layer(out, None).digest == expected_manifest(SIZE, None, {NBLOCKS - 1: padded}).digest
    with Qcow2Image(out) as img:
        found = img.block_kind(NBLOCKS - 1)
        assert found is not None and found[1] is not None
        with out.open("rb") as f:
            f.seek(found[1])
            assert f.read(B) == padded  # the file itself holds zeros past the disk's end


def _refuse(tmp_path: Path, match: str, **kwargs: object) -> None:
    args: dict[str, object] = {
        "virtual_size": SIZE,
        "backing": None,
        "records": [],
        "read_block": lambda i: b"\x01" * B,
    }
    args.update(kwargs)
    call: Callable[..., None] = write_layer
    with pytest.raises(ValueError, match=match):
        call(tmp_path / "bad.qcow2", **args)


def test_refuses_bad_input(tmp_path: Path) -> None:
    _refuse(tmp_path, "ascending", records=[(5, False), (4, False)])
    _refuse(tmp_path, "ascending", records=[(5, False), (5, True)])
    _refuse(tmp_path, "outside", records=[(NBLOCKS, False)])
    _refuse(tmp_path, "outside", records=[(-1, True)])
    _refuse(tmp_path, "returned 4095 bytes", records=[(1, False)], read_block=lambda i: b"\x01" * (B - 1))
    _refuse(tmp_path, "returned 8192 bytes", records=[(1, False)], read_block=lambda i: b"\x01" * 2 * B)
    _refuse(tmp_path, "multiple of 512", virtual_size=SIZE + 1)
    _refuse(tmp_path, "multiple of 512", virtual_size=-512)
    _refuse(tmp_path, "non-empty", backing="")
    _refuse(tmp_path, "NUL", backing="a\0b")
    _refuse(tmp_path, "1023", backing="x" * 1024)
