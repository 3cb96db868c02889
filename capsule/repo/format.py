"""The repository's objects and their layouts (every name relative to the repository's prefix).

- ``config``: sealed JSON {format, id, created, pack_size}.
- ``keys/KEYID``: clear JSON with the scrypt parameters and the sealed master key (:mod:`capsule.repo.crypto`).
- ``packs/XX/PACKID``, format 2: ``blob… | sealed header | header length (u32 LE) | CPK2``. A blob holds up to
  ``blob_blocks`` (config; 16) neighbouring new non-zero 4 KiB blocks of one object, compressed together and
  sealed with ``blobs`` as associated data: ``codec (1: 0 raw, 1 zstd) | data`` inside; a reader checks that
  the block it takes hashes to its keyed id. The header is ``CPH2`` then per blob ``offset (u32) | length (u32)
  | count (u16)`` and its ``count`` block ids in slot order (an all-zero id: a slot no index lists), sealed with
  ``pack-header/PACKID``. A count of 0 is a format-1 blob that prune copied here: one id follows.
- ``packs/XX/PACKID``, format 1: ``blob… | sealed header | header length (u32 LE)``. A blob is one block,
  sealed with its block id as associated data; the header lists ``block id (32) | offset (u32) | length
  (u32)`` per blob.
- ``index/ID``: sealed zstd of ``CIX2 | pack count (u32)`` then per pack ``pack id (16) | blob count (u32) |
  blobs as in the header`` (format 1: ``CIX1``, then per pack ``pack id | count (u32) | entries as in its
  header``); one per writer session, never modified.
- ``manifests/NAME``: sealed zstd of a layer's or file's manifest (hashcache's manifest bytes); NAME is the
  keyed hash of (kind, object id), so the bucket never shows an object's content digest.
- ``versions/ID``: sealed JSON: a capsule version's record, its objects (kind, id, role, manifest name), the
  host that pushed it and when.
- ``locks/ID``: sealed JSON {exclusive, host, pid, time}: writers take shared locks, prune an exclusive one.

IDs are random (``secrets.token_hex(16)``), so writers on many hosts never write the same name. This Capsule
reads both formats, and writes format 1 to a repository whose config still says 1 (`capsule repo upgrade`)."""

from __future__ import annotations

import re
import secrets
import struct
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import zstandard

from capsule.errors import IntegrityError
from capsule.repo.crypto import MasterKey
from hashcache.blocks import BLOCK_SIZE, hash_block

PACK_SIZE = 4 * 1024 * 1024       # a pack is closed once its blobs reach this
GAP = 64 * 1024                   # blobs this close in one pack are fetched with one ranged GET
MAX_RANGE = 8 * 1024 * 1024       # … up to this many bytes
ENTRY = struct.Struct("<32sII")   # format 1: block id, offset, length
BLOB = struct.Struct("<IIH")      # format 2: offset, length, block count (0: a format-1 blob, one id)
INDEX_MAGIC, INDEX2_MAGIC = b"CIX1", b"CIX2"
PACK2_MAGIC, HEADER2_MAGIC = b"CPK2", b"CPH2"
BLOB_BLOCKS = 16                  # blocks in one blob of a format-2 repository (its config's blob_blocks)
MAX_BLOB_BLOCKS = 64
SINGLE = -1                       # a Place's slot for a format-1 blob: one block, its id the associated data
NO_ID = bytes(32)                 # a slot of a blob that an index does not list
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


class Place(NamedTuple):
    """Where a block lives in a pack: its sealed blob's offset and length, and its slot in the blob."""

    offset: int
    length: int
    slot: int = SINGLE


@dataclass(frozen=True)
class Entry:
    """Where a block lives: its pack, the sealed blob's offset and length in it, and its slot in the blob
    (:data:`SINGLE`: the blob is that one block, format 1)."""

    pack: str
    offset: int
    length: int
    slot: int = SINGLE

    @property
    def place(self) -> Place:
        return Place(self.offset, self.length, self.slot)


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
GROUP_AAD = b"blobs\0"


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(level=3)
    return _local.compressor


def _body(data: bytes) -> bytes:
    packed = _compressor().compress(data)
    return bytes([ZSTD]) + packed if len(packed) < len(data) else bytes([RAW]) + data


def _content(body: bytes, what: str, max_size: int) -> bytes:
    if not body or body[0] not in (RAW, ZSTD):
        raise IntegrityError(f"{what}: unknown codec")
    if body[0] == RAW:
        return body[1:]
    try:
        return zstandard.ZstdDecompressor().decompress(body[1:], max_output_size=max_size)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{what}: bad compressed data ({exc})") from exc


def seal_blob(key: MasterKey, block_id: bytes, data: bytes) -> bytes:
    """A format-1 blob: one block, its id the associated data."""
    return key.seal(_body(data), b"blob\0" + block_id)


def open_blob(key: MasterKey, block_id: bytes, sealed: bytes, what: str, max_size: int) -> bytes:
    return _content(key.open(sealed, b"blob\0" + block_id, what), what, max_size)


def seal_group(key: MasterKey, blocks: list[bytes]) -> bytes:
    """A format-2 blob: neighbouring blocks compressed together (zstd sees them as one stream)."""
    return key.seal(_body(b"".join(blocks)), GROUP_AAD)


def open_group(key: MasterKey, sealed: bytes, what: str) -> bytes:
    """A format-2 blob's content: its blocks, one after another."""
    content = _content(key.open(sealed, GROUP_AAD, what), what, MAX_BLOB_BLOCKS * BLOCK_SIZE)
    if not content or len(content) % BLOCK_SIZE:
        raise IntegrityError(f"{what}: a blob of {len(content)} bytes is not whole blocks")
    return content


def block_of(key: MasterKey, block_id: bytes, content: bytes, slot: int, what: str) -> bytes:
    """Block ``slot`` of a format-2 blob's content, checked against its keyed id (the blob's associated data
    names no block, so a blob moved to another place is caught here)."""
    block = content[slot * BLOCK_SIZE:(slot + 1) * BLOCK_SIZE]
    if len(block) != BLOCK_SIZE or key.block_id(hash_block(block)) != block_id:
        raise IntegrityError(f"{what}: the block at slot {slot} of its blob is not the one its id names")
    return block


def open_range(key: MasterKey, r: Range, data: bytes, what: str, opened: dict[int, bytes] | None = None
               ) -> dict[bytes, bytes]:
    """Block id → block, for every item of ``r`` whose range bytes are ``data``; each blob is opened once
    (``opened``, if given, receives each format-2 blob's content by its offset)."""
    opened = {} if opened is None else opened
    out = {}
    for bid, entry in r.items:
        sealed = r.blob(data, entry)
        if entry.slot == SINGLE:
            out[bid] = open_blob(key, bid, sealed, what, BLOCK_SIZE)
            continue
        content = opened.get(entry.offset)
        if content is None:
            content = opened[entry.offset] = open_group(key, sealed, what)
        out[bid] = block_of(key, bid, content, entry.slot, what)
    return out


# -- packs ----------------------------------------------------------------------------

class PackWriter:
    """Blobs gathered into one pack; :meth:`finish` gives its bytes and its places. A pack of format-1 blobs
    only is written in format 1 (a format-1 repository stays readable by the Capsules that wrote it)."""

    def __init__(self, key: MasterKey) -> None:
        self.key = key
        self.id = new_id()
        self._parts: list[bytes] = []
        self.size = 0
        self.entries: dict[bytes, Place] = {}

    def _append(self, members: dict[bytes, int], sealed: bytes) -> None:
        for bid, slot in members.items():
            self.entries[bid] = Place(self.size, len(sealed), slot)
        self._parts.append(sealed)
        self.size += len(sealed)

    def add(self, block_id: bytes, data: bytes) -> None:
        """One block as a format-1 blob."""
        if block_id not in self.entries:
            self._append({block_id: SINGLE}, seal_blob(self.key, block_id, data))

    def add_group(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """Blocks (id, data) as one format-2 blob, in this order; ids already here are left out."""
        fresh = {bid: data for bid, data in blocks if bid not in self.entries}
        if not fresh:
            return
        if len(fresh) > MAX_BLOB_BLOCKS:
            raise ValueError(f"a blob holds at most {MAX_BLOB_BLOCKS} blocks")
        self._append({bid: slot for slot, bid in enumerate(fresh)}, seal_group(self.key, list(fresh.values())))

    def add_sealed(self, members: dict[bytes, int], sealed: bytes) -> None:
        """A blob as it was sealed in another pack, with its block ids → slots (prune's repacking: its
        associated data names no pack, so it moves unopened)."""
        members = {bid: slot for bid, slot in members.items() if bid not in self.entries}
        if members:
            self._append(members, sealed)

    def __len__(self) -> int:
        return len(self.entries)

    def finish(self) -> bytes:
        if all(p.slot == SINGLE for p in self.entries.values()):
            sealed = self.key.seal(_encode_entries(self.entries), f"pack-header/{self.id}")
            return b"".join(self._parts) + sealed + struct.pack("<I", len(sealed))
        sealed = self.key.seal(HEADER2_MAGIC + _encode_blobs(self.entries), f"pack-header/{self.id}")
        return b"".join(self._parts) + sealed + struct.pack("<I", len(sealed)) + PACK2_MAGIC


def _encode_entries(places: dict[bytes, Place]) -> bytes:
    """Format 1's entries: ``block id | offset | length`` per (single-block) blob."""
    return b"".join(ENTRY.pack(bid, p.offset, p.length) for bid, p in places.items())


def blobs_of(places: dict[bytes, Place]) -> dict[tuple[int, int], dict[bytes, int]]:
    """A pack's places blob by blob, in pack order: (offset, length) → block id → slot."""
    out: dict[tuple[int, int], dict[bytes, int]] = defaultdict(dict)
    for bid, p in places.items():
        out[(p.offset, p.length)][bid] = p.slot
    return dict(sorted(out.items()))


def _encode_blobs(places: dict[bytes, Place]) -> bytes:
    """Format 2's list of blobs: each blob's place, then its ids by slot."""
    blobs = blobs_of(places)
    parts = [struct.pack("<I", len(blobs))]
    for (off, n), members in blobs.items():
        by_slot = {slot: bid for bid, slot in members.items()}
        if SINGLE in by_slot:
            parts += [BLOB.pack(off, n, 0), by_slot[SINGLE]]
            continue
        count = max(by_slot) + 1
        parts.append(BLOB.pack(off, n, count))
        parts.extend(by_slot.get(slot, NO_ID) for slot in range(count))
    return b"".join(parts)


def _decode_blobs(raw: bytes, pos: int, what: str, body_end: int | None = None) -> tuple[dict[bytes, Place], int]:
    """The places of one list of blobs at ``raw[pos:]``, and where it ends."""
    if pos + 4 > len(raw):
        raise IntegrityError(f"{what}: truncated")
    (nblobs,) = struct.unpack_from("<I", raw, pos)
    pos += 4
    out: dict[bytes, Place] = {}
    for _ in range(nblobs):
        if pos + BLOB.size > len(raw):
            raise IntegrityError(f"{what}: truncated")
        off, n, count = BLOB.unpack_from(raw, pos)
        pos += BLOB.size
        if count > MAX_BLOB_BLOCKS:
            raise IntegrityError(f"{what}: a blob of {count} blocks (at most {MAX_BLOB_BLOCKS})")
        if body_end is not None and off + n > body_end:
            raise IntegrityError(f"{what}: an entry points past the blobs")
        ids = max(count, 1)
        if pos + 32 * ids > len(raw):
            raise IntegrityError(f"{what}: truncated")
        for slot in range(ids):
            bid = raw[pos + 32 * slot:pos + 32 * (slot + 1)]
            if bid != NO_ID:
                out[bid] = Place(off, n, slot if count else SINGLE)
        pos += 32 * ids
    return out, pos


def pack_trailer(tail: bytes, size: int, pack: str) -> tuple[int, int]:
    """Where a pack's sealed header starts and its length, from the pack's last (up to 8) bytes."""
    if tail.endswith(PACK2_MAGIC) and len(tail) >= 8:
        (hlen,) = struct.unpack("<I", tail[-8:-4])
        end = size - 8
    elif len(tail) >= 4:
        (hlen,) = struct.unpack("<I", tail[-4:])
        end = size - 4
    else:
        raise IntegrityError(f"pack {pack} is truncated")
    if hlen > end:
        raise IntegrityError(f"pack {pack}: its header length is past its start")
    return end - hlen, hlen


def read_pack_header(key: MasterKey, pack: str, data: bytes) -> dict[bytes, Place]:
    """The places a whole pack's header lists, checked against the pack's size."""
    start, hlen = pack_trailer(data[-8:], len(data), pack)
    return read_pack_header_only(key, pack, data[start:start + hlen], start)


def read_pack_header_only(key: MasterKey, pack: str, sealed: bytes, body_end: int) -> dict[bytes, Place]:
    """The places of a pack's sealed header (``body_end``: where its blobs end)."""
    what = f"pack {pack}"
    header = key.open(sealed, f"pack-header/{pack}", f"the header of {what}")
    if header.startswith(HEADER2_MAGIC):
        out, pos = _decode_blobs(header, len(HEADER2_MAGIC), what, body_end)
        if pos != len(header):
            raise IntegrityError(f"{what}: {len(header) - pos} bytes after its header's last blob")
        return out
    if len(header) % ENTRY.size:
        raise IntegrityError(f"{what}: a header of {len(header)} bytes is not whole entries")
    out = {}
    for bid, off, n in ENTRY.iter_unpack(header):
        if off + n > body_end:
            raise IntegrityError(f"{what}: an entry points past the blobs")
        out[bid] = Place(off, n)
    return out


# -- indexes --------------------------------------------------------------------------

def encode_index(packs: dict[str, dict[bytes, Place]]) -> bytes:
    """An index of ``packs``: format 1 where every blob is a format-1 one, else format 2."""
    if all(p.slot == SINGLE for places in packs.values() for p in places.values()):
        parts = [INDEX_MAGIC, struct.pack("<I", len(packs))]
        for pack, places in packs.items():
            parts.append(bytes.fromhex(pack) + struct.pack("<I", len(places)))
            parts.append(_encode_entries(places))
    else:
        parts = [INDEX2_MAGIC, struct.pack("<I", len(packs))]
        for pack, places in packs.items():
            parts += [bytes.fromhex(pack), _encode_blobs(places)]
    return zstandard.ZstdCompressor(level=3).compress(b"".join(parts))


def decode_index(data: bytes, what: str) -> dict[bytes, Entry]:
    """Block id → entry, from a decrypted index; IntegrityError on anything malformed."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_INDEX_BYTES)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{what}: bad compressed data ({exc})") from exc
    if not raw.startswith((INDEX_MAGIC, INDEX2_MAGIC)) or len(raw) < 8:
        raise IntegrityError(f"{what}: not an index")
    (npacks,) = struct.unpack_from("<I", raw, 4)
    pos, out = 8, dict[bytes, Entry]()
    for _ in range(npacks):
        if pos + 16 > len(raw):
            raise IntegrityError(f"{what}: truncated")
        pack = raw[pos:pos + 16].hex()
        pos += 16
        if raw.startswith(INDEX2_MAGIC):
            places, pos = _decode_blobs(raw, pos, what)
            out.update((bid, Entry(pack, *p)) for bid, p in places.items())
            continue
        if pos + 4 > len(raw):
            raise IntegrityError(f"{what}: truncated")
        (count,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + count * ENTRY.size > len(raw):
            raise IntegrityError(f"{what}: truncated")
        for bid, off, n in ENTRY.iter_unpack(raw[pos:pos + count * ENTRY.size]):
            out[bid] = Entry(pack, off, n)
        pos += count * ENTRY.size
    if pos != len(raw):
        raise IntegrityError(f"{what}: {len(raw) - pos} bytes after its last pack")
    return out
