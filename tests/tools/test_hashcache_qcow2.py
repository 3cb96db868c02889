"""hashcache.qcow2 against images made by real qemu-img / qemu-io."""

from __future__ import annotations

import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import CorruptImageError, HashcacheError, UnsupportedImageError
from hashcache.qcow2 import DATA, ZERO, BlockRun, Qcow2Image

pytestmark = [
    pytest.mark.tools,
    pytest.mark.skipif(
        shutil.which("qemu-img") is None or shutil.which("qemu-io") is None,
        reason="needs qemu-img and qemu-io",
    ),
]

B = BLOCK_SIZE
BASE_BLOCKS = 1024 + 3  # 4 MiB + 3 blocks: the last L2 table / cluster is only partly used
ZERO_RANGE = range(100, 200)  # blocks left zero in the base


def qemu_img(*args: str | Path) -> None:
    subprocess.run(["qemu-img", *map(str, args)], check=True, capture_output=True)


def qemu_io(path: Path, *commands: str) -> None:
    args: list[str] = ["qemu-io", "-f", "qcow2"]
    for c in commands:
        args += ["-c", c]
    out = subprocess.run([*args, str(path)], check=True, capture_output=True, text=True)
    assert "error" not in out.stdout.lower() + out.stderr.lower(), out


def base_block(i: int) -> bytes:
    return bytes(B) if i in ZERO_RANGE else bytes([i % 251 + 1]) * B


def chain_raw(path: Path, tmp: Path) -> bytes:
    """The guest view of an image and its whole backing chain, as QEMU sees it."""
    out = tmp / (path.name + ".chain.raw")
    qemu_img("convert", "-O", "raw", path, out)
    return out.read_bytes()


def blocks_of(img: Qcow2Image) -> dict[int, str]:
    return {i: kind.value for i, kind, _ in img.iter_blocks()}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("qcow2")
    raw = d / "base.raw"
    raw.write_bytes(b"".join(base_block(i) for i in range(BASE_BLOCKS)))
    p = {"raw": raw, "dir": d}
    p["base64k"] = d / "base64k.qcow2"
    qemu_img("convert", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=65536", raw, p["base64k"])
    p["base128x"] = d / "base128x.qcow2"
    qemu_img(
        "convert", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=131072,extended_l2=on", raw, p["base128x"]
    )
    p["base_v2"] = d / "base_v2.qcow2"
    qemu_img("convert", "-f", "raw", "-O", "qcow2", "-o", "compat=0.10", raw, p["base_v2"])

    writes = ("write -P 0xab 4k 4k", "write -z 1M 64k", "write -P 0xcd 2M 8k", "write -P 0 3M 4k")
    p["overlay_x"] = d / "overlay_x.qcow2"
    qemu_img(
        "create", "-f", "qcow2", "-b", p["base128x"], "-F", "qcow2",
        "-o", "cluster_size=131072,extended_l2=on", p["overlay_x"],
    )  # fmt: skip
    qemu_io(p["overlay_x"], *writes)
    p["overlay_std"] = d / "overlay_std.qcow2"
    qemu_img(
        "create",
        "-f",
        "qcow2",
        "-b",
        p["base64k"],
        "-F",
        "qcow2",
        "-o",
        "cluster_size=65536",
        p["overlay_std"],
    )
    qemu_io(p["overlay_std"], *writes)
    p["overlay_v2"] = d / "overlay_v2.qcow2"
    qemu_img("create", "-f", "qcow2", "-b", p["base_v2"], "-F", "qcow2", "-o", "compat=0.10", p["overlay_v2"])
    qemu_io(p["overlay_v2"], *writes)
    return p


def check_root_layer(path: Path, raw: bytes) -> Qcow2Image:
    """A root layer: allocated blocks read exactly the raw data, unallocated blocks are zero in the raw."""
    img = Qcow2Image(path)
    assert img.virtual_size == len(raw)
    assert img.block_count == -(-len(raw) // B)
    listed = blocks_of(img)
    assert listed, "qemu-img convert of non-zero data must allocate something"
    for i in range(img.block_count):
        expect = raw[i * B : (i + 1) * B].ljust(B, b"\0")
        got = img.read_block(i)
        if got is None:
            assert i not in listed
            assert expect == bytes(B), f"block {i} unallocated but holds data"
        else:
            assert i in listed
            assert got == expect, f"block {i}"
    # Every block with data is allocated: nothing lost.
    assert all(i in listed for i in range(BASE_BLOCKS) if i not in ZERO_RANGE)
    return img


@pytest.mark.parametrize("name", ["base64k", "base128x", "base_v2"])
def test_root_layer_reads_like_raw(images: dict[str, Path], name: str) -> None:
    with check_root_layer(images[name], images["raw"].read_bytes()) as img:
        assert img.backing_file is None
        assert img.backing_format is None
        assert img.version == (2 if name == "base_v2" else 3)


def test_header_fields(images: dict[str, Path]) -> None:
    with Qcow2Image(images["base64k"]) as img:
        assert (img.cluster_size, img.extended_l2, img.subcluster_size) == (65536, False, 65536)
    with Qcow2Image(images["overlay_x"]) as img:
        assert (img.cluster_size, img.extended_l2, img.subcluster_size) == (131072, True, 4096)
        assert img.backing_file == str(images["base128x"])
        assert img.backing_format == "qcow2"
        assert img.virtual_size == BASE_BLOCKS * B


def test_extended_l2_overlay_lists_exactly_written_blocks(images: dict[str, Path]) -> None:
    with Qcow2Image(images["overlay_x"]) as img:
        expected = {1: "data", 512: "data", 513: "data", 768: "data"}
        expected |= {i: "zero" for i in range(256, 272)}  # write -z 1M 64k: 16 zero subclusters
        assert blocks_of(img) == expected


def test_standard_l2_overlay_allocates_whole_clusters(images: dict[str, Path]) -> None:
    with Qcow2Image(images["overlay_std"]) as img:
        # 64 KiB clusters: a 4 KiB write allocates (copy-on-write) the whole 16-block cluster; write -z
        # of a whole cluster sets the v3 zero flag.
        expected = {i: "data" for i in [*range(0, 16), *range(512, 528), *range(768, 784)]}
        expected |= {i: "zero" for i in range(256, 272)}
        assert blocks_of(img) == expected


def test_v2_overlay_has_no_zero_clusters(images: dict[str, Path]) -> None:
    with Qcow2Image(images["overlay_v2"]) as img:
        kinds = blocks_of(img)
        assert set(kinds.values()) == {"data"}  # v2 has no zero flag: zeros are written as data
        assert set(range(256, 272)) <= set(kinds)
        assert all(img.read_block(i) == bytes(B) for i in range(256, 272))


@pytest.mark.parametrize("name", ["overlay_x", "overlay_std", "overlay_v2"])
def test_overlay_blocks_match_qemu_chain(images: dict[str, Path], name: str, tmp_path: Path) -> None:
    path = images[name]
    chain = chain_raw(path, tmp_path)
    raw = images["raw"].read_bytes()
    with Qcow2Image(path) as img:
        listed = blocks_of(img)
        for i in range(img.block_count):
            got = img.read_block(i)
            chain_block = chain[i * B : (i + 1) * B]
            if got is None:
                # Falls through to the base, and the chain agrees with the base there.
                assert chain_block == raw[i * B : (i + 1) * B], f"block {i}"
            else:
                assert got == chain_block, f"block {i}"
                if listed[i] == "zero":
                    assert got == bytes(B)
        # The writes are visible through the reader.
        assert img.read_block(1) == b"\xab" * B
        assert img.read_block(512) == img.read_block(513) == b"\xcd" * B
        assert img.read_block(768) == bytes(B)
        if name == "overlay_x":  # subclusters: the neighbour of a 4 KiB write stays unallocated
            assert img.read_block(2) is None


def test_block_runs_agree_with_blocks(images: dict[str, Path]) -> None:
    for name in ("base64k", "base128x", "overlay_x", "overlay_std"):
        with Qcow2Image(images[name]) as img:
            runs = list(img.iter_block_runs(max_blocks=7))
            assert all(1 <= r.count <= 7 for r in runs)
            expanded = []
            for r in runs:
                for k in range(r.count):
                    host = None if r.host_offset is None else r.host_offset + k * B
                    expanded.append((r.start + k, r.kind, host))
            assert expanded == list(img.iter_blocks())
            # Runs are maximal up to max_blocks: big runs for contiguous base data.
            big = list(img.iter_block_runs())
            assert len(big) <= len(runs)
            for r in big:
                if r.kind is DATA:
                    assert img.read_run(r) == b"".join(
                        img.read_block(r.start + k) or b"" for k in range(r.count)
                    )
                else:
                    assert r.host_offset is None and img.read_run(r) == bytes(r.count * B)


def test_base_runs_are_large(images: dict[str, Path]) -> None:
    # Converted images store data contiguously: runs must merge across clusters for fast reads.
    with Qcow2Image(images["base64k"]) as img:
        runs = list(img.iter_block_runs())
        assert len(runs) <= 4
        assert sum(r.count for r in runs) == len(list(img.iter_blocks()))


def test_large_subclusters_expand_to_blocks(tmp_path: Path) -> None:
    path = tmp_path / "2m.qcow2"
    qemu_img("create", "-f", "qcow2", "-o", "cluster_size=2M,extended_l2=on", path, "8M")
    qemu_io(path, "write -P 0x5a 64k 64k", "write -z 192k 64k")
    with Qcow2Image(path) as img:
        assert img.subcluster_size == 65536
        expected = {i: "data" for i in range(16, 32)} | {i: "zero" for i in range(48, 64)}
        assert blocks_of(img) == expected
        assert img.read_block(20) == b"\x5a" * B


def test_partial_last_block(tmp_path: Path) -> None:
    path = tmp_path / "odd.qcow2"
    size = 1024 * 1024 + 512
    qemu_img("create", "-f", "qcow2", path, str(size))
    qemu_io(path, f"write -P 0x77 {size - 512} 512")
    with Qcow2Image(path) as img:
        assert img.block_count == 257
        assert [i for i, _, _ in img.iter_blocks()][-1] == 256
        assert img.read_block(256) == b"\x77" * 512 + bytes(B - 512)
        with pytest.raises(IndexError):
            img.read_block(257)


def test_preallocated_metadata_is_not_data(tmp_path: Path) -> None:
    path = tmp_path / "prealloc.qcow2"
    qemu_img("create", "-f", "qcow2", "-o", "preallocation=metadata", path, "1M")
    with Qcow2Image(path) as img:
        # Host clusters reserved, guest content never written: QEMU reports them as data (reading
        # zeros from the sparse file); the reader lists them and they read as zeros.
        assert len(list(img.iter_blocks())) == 256
        for i, kind, _ in img.iter_blocks():
            assert kind is DATA
            assert img.read_block(i) == bytes(B)


# -- refused images --------------------------------------------------------------------------------


def test_compressed_clusters_refused(images: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "comp.qcow2"
    qemu_img("convert", "-c", "-f", "raw", "-O", "qcow2", images["raw"], path)
    with Qcow2Image(path) as img, pytest.raises(UnsupportedImageError, match="compressed"):
        list(img.iter_blocks())
    with Qcow2Image(path) as img, pytest.raises(UnsupportedImageError, match="comp.qcow2"):
        img.read_block(0)


def test_encrypted_refused(tmp_path: Path) -> None:
    path = tmp_path / "enc.qcow2"
    qemu_img(
        "create", "-f", "qcow2", "--object", "secret,id=sec0,data=abc123",
        "-o", "encrypt.format=luks,encrypt.key-secret=sec0", path, "1M",
    )  # fmt: skip
    with pytest.raises(UnsupportedImageError, match="encrypted"):
        Qcow2Image(path)


def test_external_data_file_refused(tmp_path: Path) -> None:
    path = tmp_path / "ext.qcow2"
    qemu_img("create", "-f", "qcow2", "-o", f"data_file={tmp_path / 'ext.raw'}", path, "1M")
    with pytest.raises(UnsupportedImageError, match="external data file"):
        Qcow2Image(path)


@pytest.mark.parametrize("opts", ["cluster_size=65536,extended_l2=on", "cluster_size=2048"])
def test_allocation_unit_below_4k_refused(tmp_path: Path, opts: str) -> None:
    path = tmp_path / "small.qcow2"
    qemu_img("create", "-f", "qcow2", "-o", opts, path, "1M")
    with pytest.raises(UnsupportedImageError, match="smaller than the 4096-byte block"):
        Qcow2Image(path)


# -- damaged images --------------------------------------------------------------------------------


def patched(src: Path, dst: Path, offset: int, fmt: str, value: int) -> Path:
    data = bytearray(src.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    dst.write_bytes(data)
    return dst


def test_garbage_header(tmp_path: Path) -> None:
    path = tmp_path / "garbage.qcow2"
    path.write_bytes(random.Random(1).randbytes(65536))
    with pytest.raises(CorruptImageError, match=r"garbage\.qcow2: not a qcow2 image"):
        Qcow2Image(path)


def test_tiny_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.qcow2"
    path.write_bytes(b"QFI\xfb\0\0")
    with pytest.raises(CorruptImageError, match="tiny.qcow2"):
        Qcow2Image(path)


def test_truncated_image(images: dict[str, Path], tmp_path: Path) -> None:
    data = images["overlay_x"].read_bytes()
    with Qcow2Image(images["overlay_x"]) as img:
        last_data = max(h for _, k, h in img.iter_blocks() if k is DATA)
    # Cut inside the last data block: opening works, reading the layer must fail loudly.
    path = tmp_path / "trunc.qcow2"
    path.write_bytes(data[: last_data + 100])
    with Qcow2Image(path) as img, pytest.raises(CorruptImageError, match="beyond the end of the file"):
        list(img.iter_blocks())
    # Cut inside the header cluster.
    path.write_bytes(data[:200])
    with pytest.raises(CorruptImageError, match="trunc.qcow2"):
        Qcow2Image(path)


def test_l1_offset_beyond_eof(images: dict[str, Path], tmp_path: Path) -> None:
    path = patched(images["base64k"], tmp_path / "l1.qcow2", 40, ">Q", 1 << 40)
    with pytest.raises(CorruptImageError, match=r"l1\.qcow2: L1 table .* beyond the end of the file"):
        Qcow2Image(path)


def test_l1_offset_unaligned(images: dict[str, Path], tmp_path: Path) -> None:
    with Qcow2Image(images["base64k"]) as img:
        off = img.l1_table_offset
    path = patched(images["base64k"], tmp_path / "l1u.qcow2", 40, ">Q", off + 512)
    with pytest.raises(CorruptImageError, match="L1 table offset"):
        Qcow2Image(path)


def test_l2_offset_beyond_eof(images: dict[str, Path], tmp_path: Path) -> None:
    with Qcow2Image(images["base64k"]) as img:
        l1 = img.l1_table_offset
    path = patched(images["base64k"], tmp_path / "l2.qcow2", l1, ">Q", (1 << 63) | (1 << 40))
    with Qcow2Image(path) as img, pytest.raises(CorruptImageError, match="L2 table at offset"):
        list(img.iter_blocks())


def test_cluster_bits_out_of_range(images: dict[str, Path], tmp_path: Path) -> None:
    path = patched(images["base64k"], tmp_path / "cb.qcow2", 20, ">I", 30)
    with pytest.raises(CorruptImageError, match="cluster_bits is 30"):
        Qcow2Image(path)


def test_virtual_size_larger_than_l1(images: dict[str, Path], tmp_path: Path) -> None:
    path = patched(images["base64k"], tmp_path / "vs.qcow2", 24, ">Q", 1 << 50)
    with pytest.raises(CorruptImageError, match="L1 table has 1 entries"):
        Qcow2Image(path)


def test_unknown_incompatible_feature(images: dict[str, Path], tmp_path: Path) -> None:
    path = patched(images["base64k"], tmp_path / "feat.qcow2", 72, ">Q", 1 << 20)
    with pytest.raises(UnsupportedImageError, match="bit 20"):
        Qcow2Image(path)


def test_corrupt_bit(images: dict[str, Path], tmp_path: Path) -> None:
    path = patched(images["base64k"], tmp_path / "cbit.qcow2", 72, ">Q", 2)
    with pytest.raises(CorruptImageError, match="marked this image corrupt"):
        Qcow2Image(path)


def test_future_version(images: dict[str, Path], tmp_path: Path) -> None:
    path = patched(images["base64k"], tmp_path / "v9.qcow2", 4, ">I", 9)
    with pytest.raises(UnsupportedImageError, match="version 9"):
        Qcow2Image(path)


def test_subcluster_both_allocated_and_zero(images: dict[str, Path], tmp_path: Path) -> None:
    with Qcow2Image(images["overlay_x"]) as img:
        l2 = img._l2_offset(0)  # the only L2 table of a 4 MiB disk
    data = bytearray(images["overlay_x"].read_bytes())
    # Cluster 0's bitmap has subcluster 1 allocated; also mark it zero.
    (bitmap,) = struct.unpack_from(">Q", data, l2 + 8)
    assert bitmap & 2
    struct.pack_into(">Q", data, l2 + 8, bitmap | (2 << 32))
    path = tmp_path / "both.qcow2"
    path.write_bytes(data)
    with Qcow2Image(path) as img, pytest.raises(CorruptImageError, match="both allocated and zero"):
        list(img.iter_blocks())


def test_random_damage_raises_only_typed_errors(images: dict[str, Path], tmp_path: Path) -> None:
    """Flip bytes in the header and metadata: never an IndexError/struct.error/ValueError."""
    src = images["overlay_x"].read_bytes()
    with Qcow2Image(images["overlay_x"]) as img:
        meta = [(0, 512), (img.l1_table_offset, 64), (img._l2_offset(0), 4096)]
    rng = random.Random(1234)
    path = tmp_path / "fuzz.qcow2"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(300):
        data = bytearray(src)
        for _ in range(rng.randint(1, 4)):
            start, length = rng.choice(meta)
            data[start + rng.randrange(length)] ^= 1 << rng.randrange(8)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        path.write_bytes(data)
        try:
            with Qcow2Image(path) as img:
                for i, kind, _ in img.iter_blocks():
                    if kind is ZERO or i % 7 == 0:
                        img.read_block(i)
            outcomes["ok"] += 1
        except HashcacheError as e:
            assert str(path) in str(e)
            outcomes["error"] += 1
    assert outcomes["error"] > 0 and outcomes["ok"] > 0


def test_closed_image(images: dict[str, Path]) -> None:
    img = Qcow2Image(images["base64k"])
    img.close()
    img.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        img.read_block(0)


def test_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(CorruptImageError, match="not a regular file"):
        Qcow2Image(tmp_path)
    with pytest.raises(FileNotFoundError):
        Qcow2Image(tmp_path / "missing.qcow2")


def test_read_run_into_rejects_small_buffer(images: dict[str, Path]) -> None:
    with Qcow2Image(images["base64k"]) as img, pytest.raises(ValueError, match="too small"):
        img.read_run_into(BlockRun(0, 4, DATA, 0), bytearray(B))
