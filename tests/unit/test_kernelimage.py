"""The kernel as it unpacks itself in the guest (capsule/migrate/kernelimage.py), and the memory codec's
references to its blocks (capsule/migrate/memrefs.py): every format a bzImage's payload comes in unpacks to the
same bytes, what is no bzImage (or unpacks to too much, or to no ELF) has no unpacked kernel, and a guest's
pages equal to the unpacked kernel's go as runs of its blocks that the destination rebuilds from its own copy."""

from __future__ import annotations

import gzip
import lzma
import os
import struct
from types import SimpleNamespace

import lz4.block
import pytest
import zstandard

from capsule.errors import IntegrityError, InvalidName
from capsule.migrate import kernelimage, memrefs
from capsule.migrate.kernelimage import KernelImage, unpack
from capsule.migrate.ramdedup import Decoder, Encoder
from capsule.store import Store
from hashcache.manifest import manifest_of_file
from tests.helpers.migstream import guest_order

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

ELF = b"\x7fELF" + bytes(4092) + b"".join(os.urandom(2048) * 2 for _ in range(15))   # 16 pages, one mostly zero


def bzimage(payload: bytes, *, setup_sects: int = 3, version: int = 0x20F) -> bytes:
    """A bzImage as Linux's build lays it out: setup sectors with the boot protocol's header, then the
    protected-mode code (here a stub) with the compressed kernel at payload_offset."""
    head = bytearray(((setup_sects or 4) + 1) * 512)
    head[0x1F1] = setup_sects
    head[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", head, 0x206, version)
    stub = b"\x90" * 716
    struct.pack_into("<II", head, 0x248, len(stub), len(payload))
    return bytes(head) + stub + payload + bytes(300)


def lz4_legacy(data: bytes) -> bytes:
    """LZ4's legacy frames as the kernel's build writes them: 8 MiB blocks, then the unpacked size."""
    out = bytearray(kernelimage.LZ4_LEGACY)
    for i in range(0, len(data), kernelimage.LZ4_BLOCK):
        block = lz4.block.compress(data[i:i + kernelimage.LZ4_BLOCK], store_size=False)
        out += struct.pack("<I", len(block)) + block
    return bytes(out + struct.pack("<I", len(data)))


def _sized(packed: bytes, size: int) -> bytes:
    return packed + struct.pack("<I", size)            # every format: the build appends the unpacked size


PACKERS = {
    "lz4": lz4_legacy,
    "zstd": lambda d: _sized(zstandard.ZstdCompressor(level=19).compress(d), len(d)),
    "gzip": lambda d: _sized(gzip.compress(d), len(d)),
    "xz": lambda d: _sized(lzma.compress(d, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32), len(d)),
}


@pytest.mark.parametrize("fmt", sorted(PACKERS))
def test_every_payload_format_unpacks_to_the_kernel(fmt):
    assert unpack(bzimage(PACKERS[fmt](ELF))) == ELF
    assert unpack(bzimage(PACKERS[fmt](ELF), setup_sects=0)) == ELF   # 0 setup sectors means 4


def test_lz4_legacy_frames_of_several_blocks_unpack_whole():
    big = b"\x7fELF" + os.urandom(kernelimage.LZ4_BLOCK + 5000)
    assert unpack(bzimage(lz4_legacy(big))) == big


@pytest.mark.parametrize("data", [
    b"", os.urandom(4096), ELF,                                              # no boot header at all
    bzimage(lz4_legacy(ELF), version=0x207),                                 # before payload_offset existed
    bzimage(lz4_legacy(ELF))[:3000],                                         # the payload cut off
    bzimage(b"BZh91AY&SY" + os.urandom(500)),                                # bzip2: not read here
    bzimage(lz4_legacy(b"MZ" + os.urandom(8000))),                           # unpacks to no ELF
    bzimage(_sized(zstandard.ZstdCompressor().compress(ELF), len(ELF))[:200]),  # a cut zstd frame
], ids=["empty", "random", "elf", "old-protocol", "cut-file", "bzip2", "no-elf", "cut-zstd"])
def test_what_is_no_bzimage_this_reads_has_no_unpacked_kernel(data):
    assert unpack(data) is None


@pytest.mark.parametrize("fmt", sorted(PACKERS))
def test_a_payload_that_unpacks_past_the_bound_is_refused(fmt, monkeypatch):
    monkeypatch.setattr(kernelimage, "MAX_IMAGE", 8 * 4096)                 # ELF is 16 pages
    assert unpack(bzimage(PACKERS[fmt](ELF))) is None


def test_the_unpacked_kernels_manifest_is_a_files(tmp_path):
    image = KernelImage.of(bzimage(lz4_legacy(ELF)))
    assert image is not None
    (tmp_path / "vmlinux").write_bytes(ELF)
    assert image.manifest == manifest_of_file(tmp_path / "vmlinux")
    assert image.read([0, 15]) == [ELF[:4096], ELF[15 * 4096:]]


def _store_with_kernel(path, bz: bytes) -> tuple[Store, str]:
    store = Store.open(path)
    src = path.parent / f"{path.name}-kernel"
    src.write_bytes(bz)
    row = store.seal_file(src, "kernel")
    store.catalogue.add_file(row)
    return store, row.id


def _version(fid: str) -> SimpleNamespace:
    return SimpleNamespace(chains=[], config={"kernel": fid}, capsule="c", number=1)


def test_pages_of_the_unpacked_kernel_go_as_runs_and_come_back_from_the_other_hosts_copy(tmp_path):
    bz = bzimage(lz4_legacy(ELF))
    source, fid = _store_with_kernel(tmp_path / "a", bz)
    dest, fid_b = _store_with_kernel(tmp_path / "b", bz)
    assert fid == fid_b
    assert memrefs.shared_objects(source, _version(fid)) == [("file", fid)]       # a peer without the feature
    objects = memrefs.shared_objects(source, _version(fid), kernel=True)
    assert objects == [("file", fid), ("kernel", fid)]
    known = memrefs.known_of(source, objects)
    pages = [ELF[i * 4096:(i + 1) * 4096] for i in range(16)]
    guest = pages[1:12] + [os.urandom(4096)] + pages[12:]    # as the guest holds them, one page changed
    data = guest_order(guest)
    enc = Encoder(known, runs=True)
    frames = enc.encode(data) + enc.finish()
    assert (enc.stats.refs, enc.stats.raw_pages) == (15, 1)
    resolver = memrefs.StoreResolver(dest, memrefs.parse_objects([list(o) for o in objects]))
    dec = Decoder(resolver)
    try:
        assert dec.decode(frames) == data
        dec.finish()
    finally:
        resolver.close()
    assert dec.stats.refs == 15 and len(frames) < 2 * 4096


def test_a_kernel_the_destination_does_not_hold_or_cannot_unpack_fails_the_move_cleanly(tmp_path):
    source, fid = _store_with_kernel(tmp_path / "a", bzimage(lz4_legacy(ELF)))
    objects = memrefs.shared_objects(source, _version(fid), kernel=True)
    data = guest_order([ELF[i * 4096:(i + 1) * 4096] for i in range(1, 16)])
    enc = Encoder(memrefs.known_of(source, objects), runs=True)
    frames = enc.encode(data) + enc.finish()
    elsewhere = Store.open(tmp_path / "b")                                       # holds no such file
    with pytest.raises(IntegrityError, match="does not hold"):
        Decoder(memrefs.StoreResolver(elsewhere, objects)).decode(frames)
    plain, other = _store_with_kernel(tmp_path / "c", b"not a kernel " * 500)  # a kernel file that does not unpack
    assert memrefs.shared_objects(plain, _version(other), kernel=True) == [("file", other)]
    with pytest.raises(IntegrityError):
        Decoder(memrefs.StoreResolver(plain, [("kernel", other)])).decode(frames)


def test_a_kernel_named_many_times_is_unpacked_once_at_the_destination(tmp_path, monkeypatch):
    dest, fid = _store_with_kernel(tmp_path / "b", bzimage(lz4_legacy(ELF)))
    made = []
    real = memrefs.kernel_image
    monkeypatch.setattr(memrefs, "kernel_image", lambda store, f: made.append(f) or real(store, f))
    resolver = memrefs.StoreResolver(dest, [("kernel", fid)] * 200)
    for obj in (0, 57, 199):
        assert resolver.blocks(obj, 1, 2) == [ELF[4096:8192], ELF[8192:12288]]
    assert made == [fid]


@pytest.mark.parametrize("objects", [[["vmlinux", "a" * 64]], [["kernel", "../x"]], [["kernel"]]])
def test_a_tunnel_request_names_only_known_kinds_and_ids(objects):
    with pytest.raises(InvalidName):
        memrefs.parse_objects(objects)


def test_the_agent_names_the_feature():
    from capsule.agent.protocol import FEATURES
    assert memrefs.KERNEL_FEATURE in FEATURES
