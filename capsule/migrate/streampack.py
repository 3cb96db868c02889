"""A tunnel channel's bytes packed with zstd, one way: the disks' NBD stream of a live move, from the source on.

A live move mirrors the guest's disk writes since T0 over NBD (libvirt's ``--copy-storage-inc``). Those bytes
went raw: B2-live's desktop, whose office day writes documents, byte-compiled files and the file system's journal
during the move, put ~25 MB on the disks' channel of its ~119 MB. :class:`Packer` makes each chunk the source's
QEMU writes the next part of one zstd stream, flushed to a block boundary (a chunk is never held back: NBD waits
for each reply), and :class:`Unpacker` at the other host gives back the same bytes. Replies (the other way) are
small and go as they came. Agents name the feature :data:`FEATURE`; a peer without it gets the bytes raw.

Each frame::

    be32 packed length, be32 raw length, packed bytes (the stream's next part, making exactly raw length bytes)

The unpacker refuses a frame beyond :data:`MAX_RAW` or whose packed part could not be zstd's output for its raw
length, stops a stream that expands past what its frame says (a small hostile frame cannot grow in memory), and
names a stream that ends inside a frame."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import zstandard

from capsule.errors import IntegrityError

FEATURE = "tunnel-pack"            # an agent that unpacks a channel names this feature
PACKABLE = ("qemu-disks",)         # the channels that may be packed
LEVEL = 3                          # zstd level: NBD's writes come at most at the link's rate
MAX_RAW = 1 << 20                  # bytes one frame makes
MAX_WINDOW = 8 << 20               # the zstd window a receiver accepts (level 3 uses 2 MiB, level 19 8 MiB)
ZSTD_BLOCK = 128 << 10             # the most one zstd block makes
_HEAD = struct.Struct(">II")


@dataclass
class PackStats:
    raw_bytes: int = 0             # the channel's bytes as QEMU wrote them
    wire_bytes: int = 0            # as they left, packed

    def add(self, other: PackStats) -> None:
        self.raw_bytes += other.raw_bytes
        self.wire_bytes += other.wire_bytes


class Bounded:
    """Where a zstd stream writer puts what one frame makes: refused as it passes the size the frame said."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._buf = bytearray()
        self._limit = 0

    def start(self, limit: int) -> None:
        self._buf, self._limit = bytearray(), limit

    def write(self, data: bytes) -> int:
        if len(self._buf) + len(data) > self._limit:
            raise IntegrityError(f"{self.what} is corrupt: a payload beyond the {self._limit} bytes its frame says")
        self._buf += data
        return len(data)

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        out, self._buf = bytes(self._buf), bytearray()
        return out


class PartReader:
    """The receiving end of one zstd stream sent in parts, each flushed to a block boundary and said to make
    ``size`` bytes (at most ``max_part``): :meth:`part` answers exactly those, or refuses the stream (a part that
    expands past its size is stopped there).

    The writer's output buffer holds a whole part and a block more: zstd keeps what it decoded but could not
    hand out once its input is used up, and the writer has no call that drains it (with the default 128 KiB
    buffer a compressible part of more than that came back short)."""

    def __init__(self, what: str, max_part: int) -> None:
        self.what = what
        self._out = Bounded(what)
        self._zstd = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_writer(
            self._out, write_size=max_part + ZSTD_BLOCK)  # type: ignore[arg-type]  # any object with write()

    def part(self, packed: bytes, size: int) -> bytes:
        self._out.start(size)
        try:
            self._zstd.write(packed)
            self._zstd.flush()
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"{self.what} is corrupt: {exc}") from None
        made = self._out.take()
        if len(made) != size:
            raise IntegrityError(f"{self.what} is corrupt: a frame made {len(made)} bytes where it says {size}")
        return made


def packed_bound(raw: int) -> int:
    """The most bytes zstd's output for ``raw`` bytes may take (a stored block's overhead, and some)."""
    return raw + (raw >> 6) + 1024


class Packer:
    """The source side: :meth:`encode` each chunk, :meth:`finish` at the end; :attr:`stats`."""

    def __init__(self, level: int = LEVEL) -> None:
        self._zstd = zstandard.ZstdCompressor(level=level).compressobj()
        self.stats = PackStats()

    def encode(self, data: bytes) -> bytes:
        out = bytearray()
        for at in range(0, len(data), MAX_RAW):
            part = data[at:at + MAX_RAW]
            packed = self._zstd.compress(part) + self._zstd.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
            out += _HEAD.pack(len(packed), len(part)) + packed
        self.stats.raw_bytes += len(data)
        self.stats.wire_bytes += len(out)
        return bytes(out)

    def finish(self) -> bytes:
        return b""


class Unpacker:
    """The other side: :meth:`decode` what arrives, in any cuts; :meth:`finish` at its end."""

    WHAT = "the packed disks stream"

    def __init__(self) -> None:
        self.stats = PackStats()
        self._buf = bytearray()
        self._parts = PartReader(self.WHAT, MAX_RAW)

    def decode(self, data: bytes) -> bytes:
        self._buf += data
        self.stats.wire_bytes += len(data)
        out = bytearray()
        while len(self._buf) >= _HEAD.size:
            packed_len, raw_len = _HEAD.unpack_from(self._buf)
            if not 0 < raw_len <= MAX_RAW or not 0 < packed_len <= packed_bound(raw_len):
                raise IntegrityError(f"{self.WHAT} is corrupt: a frame of {packed_len} bytes for {raw_len}")
            end = _HEAD.size + packed_len
            if len(self._buf) < end:
                break
            packed = bytes(self._buf[_HEAD.size:end])
            del self._buf[:end]
            out += self._parts.part(packed, raw_len)
        self.stats.raw_bytes += len(out)
        return bytes(out)

    def finish(self) -> None:
        if self._buf:
            raise IntegrityError(f"{self.WHAT} ended inside a frame ({len(self._buf)} bytes left over)")
