"""The repository's objects and their layouts (every name relative to the repository's prefix).

- ``config``: sealed JSON {format, id, created, pack_size}.
- ``keys/KEYID``: clear JSON with the scrypt parameters and the sealed master key (:mod:`capsule.repo.crypto`).
- ``packs/XX/PACKID``: ``blob… | sealed header | header length (u32 LE)``. A blob is one non-zero 4 KiB block,
  sealed with its block id as associated data: ``codec (1: 0 raw, 1 zstd) | data`` inside. The header lists
  ``block id (32) | offset (u32 LE) | length (u32 LE)`` per blob, sealed with ``pack-header/PACKID``.
- ``index/ID``: sealed zstd of ``CIX1 | pack count (u32)`` then per pack ``pack id (16) | count (u32) |
  entries as in the header``; one per writer session, never modified.
- ``manifests/NAME``: sealed zstd of a layer's or file's manifest (hashcache's manifest bytes); NAME is the
  keyed hash of (kind, object id), so the bucket never shows an object's content digest.
- ``versions/ID``: sealed JSON: a capsule version's record, its objects (kind, id, role, manifest name), the
  host that pushed it and when.
- ``locks/ID``: sealed JSON {exclusive, host, pid, time}: writers take shared locks, prune an exclusive one.

IDs are random (``secrets.token_hex(16)``), so writers on many hosts never write the same name."""

from __future__ import annotations

import re
import secrets
import struct
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import zstandard

from capsule.errors import IntegrityError
from capsule.repo.crypto import MasterKey

PACK_SIZE = 4 * 1024 * 1024       # a pack is closed once its blobs reach this
GAP = 64 * 1024                   # blobs this close in one pack are fetched with one ranged GET
MAX_RANGE = 8 * 1024 * 1024       # … up to this many bytes
ENTRY = struct.Struct("<32sII")   # block id, offset, length
INDEX_MAGIC = b"CIX1"
MAX_INDEX_BYTES = 1 << 30
RAW, ZSTD = 0, 1
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def new_id() -> str:
    return secrets.token_hex(16)


def pack_name(pack: str) -> str:
    return f"packs/{pack[:2]}/{pack}"


def is_id(value: str) -> bool:
    return bool(_HEX32.match(value))


def is_manifest_name(value: str) -> bool:
    return bool(_HEX64.match(value))


@dataclass(frozen=True)
class Entry:
    """Where a block lives: its pack, and the sealed blob's offset and length in it."""

    pack: str
    offset: int
    length: int


@dataclass(frozen=True)
class Range:
    """One ranged GET of a pack: ``length`` bytes from ``start``, holding the blobs of ``items``."""

    pack: str
    start: int
    length: int
    items: tuple[tuple[bytes, Entry], ...]

    def blob(self, data: bytes, entry: Entry) -> bytes:
        """A blob's sealed bytes, cut out of this range's ``data``."""
        return data[entry.offset - self.start:entry.offset - self.start + entry.length]


def ranges(wanted: Iterable[tuple[bytes, Entry]], gap: int = GAP, max_range: int = MAX_RANGE) -> list[Range]:
    """The ranged GETs that fetch every wanted blob: pack by pack, neighbours no more than ``gap`` bytes apart
    in one GET of at most ``max_range`` bytes (one blob larger than that still gets its own)."""
    by_pack: dict[str, dict[bytes, Entry]] = defaultdict(dict)
    for bid, entry in wanted:
        by_pack[entry.pack][bid] = entry
    out = []
    for pack, entries in by_pack.items():
        items = sorted(entries.items(), key=lambda it: it[1].offset)
        pos = 0
        while pos < len(items):
            end = pos + 1
            while (end < len(items) and items[end][1].offset - (items[end - 1][1].offset + items[end - 1][1].length)
                   <= gap and items[end][1].offset + items[end][1].length - items[pos][1].offset <= max_range):
                end += 1
            start = items[pos][1].offset
            last = items[end - 1][1]
            out.append(Range(pack, start, last.offset + last.length - start, tuple(items[pos:end])))
            pos = end
    return out


# -- blobs ----------------------------------------------------------------------------

_local = threading.local()     # a ZstdCompressor is not safe to share between threads (two pushes at once)


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(level=3)
    return _local.compressor


def seal_blob(key: MasterKey, block_id: bytes, data: bytes) -> bytes:
    packed = _compressor().compress(data)
    body = bytes([ZSTD]) + packed if len(packed) < len(data) else bytes([RAW]) + data
    return key.seal(body, b"blob\0" + block_id)


def open_blob(key: MasterKey, block_id: bytes, sealed: bytes, what: str, max_size: int) -> bytes:
    body = key.open(sealed, b"blob\0" + block_id, what)
    if not body or body[0] not in (RAW, ZSTD):
        raise IntegrityError(f"{what}: unknown codec")
    if body[0] == RAW:
        return body[1:]
    try:
        return zstandard.ZstdDecompressor().decompress(body[1:], max_output_size=max_size)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{what}: bad compressed data ({exc})") from exc


# -- packs ----------------------------------------------------------------------------

class PackWriter:
    """Blobs gathered into one pack; :meth:`finish` gives its bytes and its entries."""

    def __init__(self, key: MasterKey) -> None:
        self.key = key
        self.id = new_id()
        self._parts: list[bytes] = []
        self.size = 0
        self.entries: dict[bytes, tuple[int, int]] = {}

    def add(self, block_id: bytes, data: bytes) -> None:
        if block_id in self.entries:
            return
        sealed = seal_blob(self.key, block_id, data)
        self.entries[block_id] = (self.size, len(sealed))
        self._parts.append(sealed)
        self.size += len(sealed)

    def add_sealed(self, block_id: bytes, sealed: bytes) -> None:
        """A blob as it was sealed in another pack (prune's repacking: its associated data is its block id,
        not its pack, so it moves unopened)."""
        if block_id not in self.entries:
            self.entries[block_id] = (self.size, len(sealed))
            self._parts.append(sealed)
            self.size += len(sealed)

    def __len__(self) -> int:
        return len(self.entries)

    def finish(self) -> bytes:
        header = b"".join(ENTRY.pack(bid, off, n) for bid, (off, n) in self.entries.items())
        sealed = self.key.seal(header, f"pack-header/{self.id}")
        return b"".join(self._parts) + sealed + struct.pack("<I", len(sealed))


def read_pack_header(key: MasterKey, pack: str, data: bytes) -> dict[bytes, tuple[int, int]]:
    """The entries a whole pack's header lists, checked against the pack's size."""
    if len(data) < 4:
        raise IntegrityError(f"pack {pack} is truncated")
    (hlen,) = struct.unpack("<I", data[-4:])
    if hlen > len(data) - 4:
        raise IntegrityError(f"pack {pack}: its header length is past its start")
    return read_pack_header_only(key, pack, data[-4 - hlen:-4], len(data) - 4 - hlen)


def read_pack_header_only(key: MasterKey, pack: str, sealed: bytes, body_end: int) -> dict[bytes, tuple[int, int]]:
    """The entries of a pack's sealed header (``body_end``: where its blobs end)."""
    what = f"pack {pack}"
    header = key.open(sealed, f"pack-header/{pack}", f"the header of {what}")
    if len(header) % ENTRY.size:
        raise IntegrityError(f"{what}: a header of {len(header)} bytes is not whole entries")
    out: dict[bytes, tuple[int, int]] = {}
    for bid, off, n in ENTRY.iter_unpack(header):
        if off + n > body_end:
            raise IntegrityError(f"{what}: an entry points past the blobs")
        out[bid] = (off, n)
    return out


# -- indexes --------------------------------------------------------------------------

def encode_index(packs: dict[str, dict[bytes, tuple[int, int]]]) -> bytes:
    parts = [INDEX_MAGIC, struct.pack("<I", len(packs))]
    for pack, entries in packs.items():
        parts.append(bytes.fromhex(pack) + struct.pack("<I", len(entries)))
        parts.extend(ENTRY.pack(bid, off, n) for bid, (off, n) in entries.items())
    return zstandard.ZstdCompressor(level=3).compress(b"".join(parts))


def decode_index(data: bytes, what: str) -> dict[bytes, Entry]:
    """Block id → entry, from a decrypted index; IntegrityError on anything malformed."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_INDEX_BYTES)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{what}: bad compressed data ({exc})") from exc
    if not raw.startswith(INDEX_MAGIC) or len(raw) < 8:
        raise IntegrityError(f"{what}: not an index")
    (npacks,) = struct.unpack_from("<I", raw, 4)
    pos, out = 8, {}
    for _ in range(npacks):
        if pos + 20 > len(raw):
            raise IntegrityError(f"{what}: truncated")
        pack = raw[pos:pos + 16].hex()
        (count,) = struct.unpack_from("<I", raw, pos + 16)
        pos += 20
        if pos + count * ENTRY.size > len(raw):
            raise IntegrityError(f"{what}: truncated")
        for bid, off, n in ENTRY.iter_unpack(raw[pos:pos + count * ENTRY.size]):
            out[bid] = Entry(pack, off, n)
        pos += count * ENTRY.size
    if pos != len(raw):
        raise IntegrityError(f"{what}: {len(raw) - pos} bytes after its last pack")
    return out
