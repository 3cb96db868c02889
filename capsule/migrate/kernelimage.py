"""The kernel a guest runs, unpacked from the kernel file both hosts hold: blocks a live move's memory codec may
name (``("kernel", FILE)`` among the move's objects, :mod:`capsule.migrate.memrefs`).

QEMU boots a capsule's bzImage directly, and the kernel unpacks itself into the guest's memory. Whatever no
relocation touches (its read-only data; its code where KASLR leaves it in place) then stays there byte for byte,
page-aligned as the unpacked ELF file lays it out (its segments start at 2 MiB-aligned file offsets). Those pages
compress badly and are in neither the layers nor the kernel file as it is stored: B2-live's tiny guest holds
4,212 of them, 4.0 MB as zstd -3 of its 34 MB memory stream. Both hosts make the same bytes from the same file
(the formats below decompress deterministically), so the source names the unpacked kernel and the destination
unpacks its own copy; every block it reads is still checked against the manifest made here.

:func:`unpack` reads the boot protocol's header (``HdrS``, version ≥ 2.08: ``payload_offset`` and
``payload_length``) and decompresses the payload (LZ4's legacy frames, zstd, gzip or xz) to at most
:data:`MAX_IMAGE` bytes. A file it cannot read so (another format, a decompression bomb, no ELF inside) has no
unpacked kernel: the move sends those pages as it sends any other."""

from __future__ import annotations

import lzma
import struct
import zlib
from dataclasses import dataclass

import lz4.block
import zstandard

from hashcache.blocks import BLOCK_SIZE
from hashcache.manifest import Manifest, manifest_of_bytes

MAX_IMAGE = 128 << 20               # an unpacked kernel larger than this is not indexed (Debian's: 53 MB)
HEADER_MAGIC = b"HdrS"              # at 0x202 in a bzImage (Linux's boot protocol)
MIN_PROTOCOL = 0x208                # the first version with payload_offset/payload_length
LZ4_LEGACY = b"\x02\x21\x4c\x18"
LZ4_BLOCK = 8 << 20                 # what one legacy LZ4 block unpacks to, at most
ZSTD, GZIP, XZ = b"\x28\xb5\x2f\xfd", b"\x1f\x8b", b"\xfd7zXZ\x00"
ELF = b"\x7fELF"


def unpack(data: bytes) -> bytes | None:
    """The kernel inside the bzImage ``data`` (an ELF file), or None if it is no bzImage this reads."""
    payload = _payload(data)
    if payload is None:
        return None
    try:
        out = _decompress(payload)
    except (ValueError, zlib.error, lzma.LZMAError, zstandard.ZstdError, lz4.block.LZ4BlockError):
        return None
    return out if out is not None and len(out) <= MAX_IMAGE and out[:4] == ELF else None


def _payload(data: bytes) -> bytes | None:
    if len(data) < 0x250 or data[0x202:0x206] != HEADER_MAGIC or \
            struct.unpack_from("<H", data, 0x206)[0] < MIN_PROTOCOL:
        return None
    start = ((data[0x1F1] or 4) + 1) * 512            # the protected-mode code, after the setup sectors
    offset, length = struct.unpack_from("<II", data, 0x248)
    if not length or start + offset + length > len(data):
        return None
    return data[start + offset:start + offset + length]


def _decompress(payload: bytes) -> bytes | None:
    if payload.startswith(LZ4_LEGACY):
        return _lz4_legacy(payload)
    if payload.startswith(ZSTD):
        with zstandard.ZstdDecompressor().stream_reader(payload) as reader:
            return reader.read(MAX_IMAGE + 1)
    if payload.startswith(GZIP):
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(payload, MAX_IMAGE + 1)
    if payload.startswith(XZ):
        return lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(payload, MAX_IMAGE + 1)
    return None


def _lz4_legacy(payload: bytes) -> bytes | None:
    """LZ4's legacy frames: the magic, then blocks (le32 size, the block), each at most 8 MiB unpacked; the
    kernel's build appends the unpacked size, which reads as a block longer than what is left."""
    out = bytearray()
    pos = len(LZ4_LEGACY)
    while pos + 4 <= len(payload):
        n = struct.unpack_from("<I", payload, pos)[0]
        if payload[pos:pos + 4] == LZ4_LEGACY:       # a second frame
            pos += 4
            continue
        if pos + 4 + n > len(payload):
            break
        out += lz4.block.decompress(payload[pos + 4:pos + 4 + n], uncompressed_size=LZ4_BLOCK)
        if len(out) > MAX_IMAGE:
            return None
        pos += 4 + n
    return bytes(out)


@dataclass
class KernelImage:
    """An unpacked kernel in memory: its :attr:`manifest` (a file's) and its blocks (:meth:`read`, as
    :class:`~capsule.store.objectio.BlockReader` reads an object's)."""

    data: bytes
    manifest: Manifest

    @classmethod
    def of(cls, bzimage: bytes) -> KernelImage | None:
        data = unpack(bzimage)
        return None if data is None else cls(data, manifest_of_bytes(data))

    def read(self, indices: list[int]) -> list[bytes]:
        return [self.data[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE].ljust(BLOCK_SIZE, b"\0") for i in indices]

    def close(self) -> None:
        self.data = b""


__all__ = ["KernelImage", "MAX_IMAGE", "unpack"]
