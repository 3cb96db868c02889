"""A minimal, defensive, read-only qcow2 reader (no QEMU needed).

It answers one question: which 4 KiB guest blocks does *this file* define, and with what content?
Blocks the file does not define fall through to its backing file, which this reader never opens.

Supported: qcow2 v2 and v3, cluster sizes 4 KiB .. 2 MiB, standard and extended L2 entries
(subclusters of at least 4 KiB), zero clusters and zero subclusters, preallocated ("zero alloc")
clusters, backing file name and format.

Refused with :class:`UnsupportedImageError`: compressed clusters, encryption, external data files,
unknown incompatible features, allocation units (clusters, or subclusters with extended L2) smaller
than 4 KiB, qcow version 1.

Everything read from the file is checked before use; a malformed image raises
:class:`CorruptImageError` naming the file and the fault, never IndexError or struct.error.
"""

from __future__ import annotations

import enum
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType

from hashcache import native
from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import CorruptImageError, UnsupportedImageError

MAGIC = b"QFI\xfb"

_HEADER_V2 = struct.Struct(">4sIQIIQIIQQIIQ")  # 72 bytes
_HEADER_V3_EXTRA = struct.Struct(">QQQII")  # bytes 72..103
_V2_HEADER_LENGTH = 72
_V3_MIN_HEADER_LENGTH = 104

MIN_CLUSTER_BITS = 9
MAX_CLUSTER_BITS = 21
_MIN_EXTENDED_L2_CLUSTER_BITS = 14
_SUBCLUSTERS = 32
_MAX_L1_BYTES = 32 * 1024 * 1024  # QEMU's implementation limit
_MAX_BACKING_NAME = 1023

# Incompatible feature bits.
_INCOMPAT_DIRTY = 1 << 0
_INCOMPAT_CORRUPT = 1 << 1
_INCOMPAT_DATA_FILE = 1 << 2
_INCOMPAT_COMPRESSION = 1 << 3
_INCOMPAT_EXTL2 = 1 << 4
_INCOMPAT_KNOWN = (
    _INCOMPAT_DIRTY | _INCOMPAT_CORRUPT | _INCOMPAT_DATA_FILE | _INCOMPAT_COMPRESSION | _INCOMPAT_EXTL2
)
_INCOMPAT_NAMES = {0: "dirty", 1: "corrupt", 2: "external data file", 3: "compression type", 4: "extended L2"}

# Header extension types.
_EXT_END = 0x00000000
_EXT_BACKING_FORMAT = 0xE2792ACA
_EXT_FEATURE_TABLE = 0x6803F857
_EXT_DATA_FILE = 0x44415441

# Table entry bits.
_OFFSET_MASK = 0x00FF_FFFF_FFFF_FE00  # bits 9..55
_L1_RESERVED = 0x7F00_0000_0000_01FF  # bits 0..8 and 56..62
_L2_COMPRESSED = 1 << 62
_L2_ZERO = 1
_L2_RESERVED = 0x3F00_0000_0000_01FE  # bits 1..8 and 56..61
_SC_ALL = 0xFFFF_FFFF

_L2_CACHE_TABLES = 32


class BlockKind(enum.Enum):
    """What a guest block allocated in this file holds."""

    DATA = "data"  # stored in this file at a host offset
    ZERO = "zero"  # reads as zeros (zero cluster / subcluster), nothing stored


DATA = BlockKind.DATA
ZERO = BlockKind.ZERO


@dataclass(frozen=True, slots=True)
class BlockRun:
    """``count`` consecutive guest blocks from ``start``, all of one kind.

    For DATA the blocks are also contiguous in the file, starting at ``host_offset``; for ZERO
    ``host_offset`` is None.
    """

    start: int
    count: int
    kind: BlockKind
    host_offset: int | None


class Qcow2Image:
    """One qcow2 file opened read-only. Use as a context manager, or call :meth:`close`.

    Reads use pread, so one instance may serve several threads. OSErrors from the operating
    system (missing file, EIO) propagate unchanged; problems with the image's content raise
    CorruptImageError / UnsupportedImageError.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)  # OSError (e.g. missing) propagates
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptImageError(f"{self.path}: not a regular file")
            self.file_size = st.st_size
            self._l2_cache: dict[int, tuple[int, ...]] = {}
            self._l2_lock = threading.Lock()
            self._parse_header()
            self._l1 = self._read_l1()
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Qcow2Image:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Qcow2Image({self.path!r}, v{self.version}, size={self.virtual_size}, "
            f"cluster={self.cluster_size}, extended_l2={self.extended_l2}, backing={self.backing_file!r})"
        )

    # -- low-level reads ---------------------------------------------------------------------------

    def _corrupt(self, reason: str) -> CorruptImageError:
        return CorruptImageError(f"{self.path}: {reason}; the qcow2 image is damaged or truncated")

    def _pread(self, offset: int, length: int, what: str) -> bytes:
        """Exactly ``length`` bytes at ``offset``, or CorruptImageError naming ``what``."""
        if offset < 0 or offset + length > self.file_size:
            raise self._corrupt(
                f"{what} at offset {offset:#x} ({length} bytes) lies beyond the end of the file "
                f"({self.file_size} bytes)"
            )
        if self._fd < 0:
            raise ValueError(f"{self.path}: image is closed")
        chunks = []
        done = 0
        while done < length:
            chunk = os.pread(self._fd, length - done, offset + done)
            if not chunk:
                raise self._corrupt(f"{what} at offset {offset:#x}: file shrank while reading")
            chunks.append(chunk)
            done += len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _preadinto(self, view: memoryview, offset: int, what: str) -> None:
        length = len(view)
        if offset < 0 or offset + length > self.file_size:
            raise self._corrupt(
                f"{what} at offset {offset:#x} ({length} bytes) lies beyond the end of the file "
                f"({self.file_size} bytes)"
            )
        if self._fd < 0:
            raise ValueError(f"{self.path}: image is closed")
        done = 0
        while done < length:
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise self._corrupt(f"{what} at offset {offset:#x}: file shrank while reading")
            done += n

    # -- header ------------------------------------------------------------------------------------

    def _parse_header(self) -> None:
        if self.file_size < _HEADER_V2.size:
            raise CorruptImageError(
                f"{self.path}: not a qcow2 image: only {self.file_size} bytes, a qcow2 header needs "
                f"{_HEADER_V2.size}"
            )
        head = self._pread(0, min(self.file_size, _V3_MIN_HEADER_LENGTH), "header")
        (
            magic,
            version,
            backing_offset,
            backing_size,
            cluster_bits,
            virtual_size,
            crypt_method,
            l1_size,
            l1_offset,
            refcount_offset,
            refcount_clusters,
            nb_snapshots,
            snapshots_offset,
        ) = _HEADER_V2.unpack_from(head)
        if magic != MAGIC:
            raise CorruptImageError(
                f"{self.path}: not a qcow2 image (magic is {magic!r}, expected {MAGIC!r})"
            )
        if version == 1:
            raise UnsupportedImageError(
                f"{self.path}: qcow (version 1) images are not supported; convert it with "
                "'qemu-img convert -O qcow2'"
            )
        if version > 3:
            raise UnsupportedImageError(
                f"{self.path}: qcow2 version {version} is newer than this reader (2, 3)"
            )
        if version != 2 and version != 3:
            raise self._corrupt(f"invalid qcow2 version {version}")
        self.version: int = version

        if not MIN_CLUSTER_BITS <= cluster_bits <= MAX_CLUSTER_BITS:
            raise self._corrupt(
                f"cluster_bits is {cluster_bits}, must be {MIN_CLUSTER_BITS}..{MAX_CLUSTER_BITS}"
            )
        self.cluster_bits: int = cluster_bits
        self.cluster_size: int = 1 << cluster_bits

        incompat = compat = autoclear = 0
        refcount_order = 4
        header_length = _V2_HEADER_LENGTH
        self.compression_type = 0
        if version == 3:
            if len(head) < _V3_MIN_HEADER_LENGTH:
                raise self._corrupt(f"version 3 header needs {_V3_MIN_HEADER_LENGTH} bytes")
            incompat, compat, autoclear, refcount_order, header_length = _HEADER_V3_EXTRA.unpack_from(
                head, _V2_HEADER_LENGTH
            )
            if header_length < _V3_MIN_HEADER_LENGTH or header_length % 8:
                raise self._corrupt(f"header_length {header_length} is not a multiple of 8 >= 104")
            if header_length > self.cluster_size or header_length > self.file_size:
                raise self._corrupt(f"header_length {header_length} exceeds the first cluster or the file")
            if header_length > _V3_MIN_HEADER_LENGTH:
                self.compression_type = self._pread(_V3_MIN_HEADER_LENGTH, 1, "compression type")[0]
            if refcount_order > 6:
                raise self._corrupt(f"refcount_order {refcount_order} is larger than 6")
        self.incompatible_features: int = incompat
        self.compatible_features: int = compat
        self.autoclear_features: int = autoclear

        # Backing file name (needed before the extensions: it bounds the extension area).
        self.backing_file: str | None = None
        if backing_offset:
            if not 0 < backing_size <= _MAX_BACKING_NAME:
                raise self._corrupt(f"backing file name length {backing_size} is not 1..{_MAX_BACKING_NAME}")
            if backing_offset + backing_size > self.cluster_size:
                raise self._corrupt("backing file name does not fit in the first cluster")
            raw = self._pread(backing_offset, backing_size, "backing file name")
            try:
                self.backing_file = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise self._corrupt("backing file name is not valid UTF-8") from e
            if "\0" in self.backing_file:
                raise self._corrupt("backing file name contains a NUL byte")

        ext_start = header_length
        ext_end = backing_offset if backing_offset else self.cluster_size
        if ext_end < ext_start:
            raise self._corrupt("backing file name overlaps the header")
        self.backing_format: str | None = None
        feature_names = self._parse_extensions(ext_start, ext_end)

        # Features: refuse what we cannot read faithfully.
        if crypt_method != 0:
            method = {1: "AES", 2: "LUKS"}.get(crypt_method, f"method {crypt_method}")
            raise UnsupportedImageError(
                f"{self.path}: image is encrypted ({method}); decrypt it first "
                "('qemu-img convert -O qcow2' with the secret) - encrypted layers are not supported"
            )
        unknown = incompat & ~_INCOMPAT_KNOWN
        if unknown:
            bits = [b for b in range(64) if unknown >> b & 1]
            names = ", ".join(
                f"bit {b}" + (f" ({feature_names[b]})" if b in feature_names else "") for b in bits
            )
            raise UnsupportedImageError(
                f"{self.path}: image uses incompatible features this reader does not know: {names}"
            )
        if incompat & _INCOMPAT_CORRUPT:
            raise CorruptImageError(
                f"{self.path}: QEMU has marked this image corrupt; inspect and repair it with "
                "'qemu-img check -r all' before using it"
            )
        if incompat & _INCOMPAT_DATA_FILE:
            raise UnsupportedImageError(
                f"{self.path}: image keeps its data in an external data file, which is not supported; "
                "convert it to a self-contained qcow2 with 'qemu-img convert -O qcow2'"
            )
        self.dirty: bool = bool(incompat & _INCOMPAT_DIRTY)
        self.extended_l2: bool = bool(incompat & _INCOMPAT_EXTL2)
        if self.extended_l2 and cluster_bits < _MIN_EXTENDED_L2_CLUSTER_BITS:
            raise self._corrupt(
                f"extended L2 entries need clusters of at least 16 KiB, not {self.cluster_size}"
            )
        self.subcluster_size: int = (
            self.cluster_size // _SUBCLUSTERS if self.extended_l2 else self.cluster_size
        )
        if self.subcluster_size < BLOCK_SIZE:
            what = "subclusters" if self.extended_l2 else "clusters"
            raise UnsupportedImageError(
                f"{self.path}: allocation unit is {self.subcluster_size}-byte {what}, smaller than the "
                f"{BLOCK_SIZE}-byte block; create images with cluster_size >= 4k (or >= 128k with "
                "extended_l2=on)"
            )
        self._l2_entry_size = 16 if self.extended_l2 else 8
        self.l2_entries: int = self.cluster_size // self._l2_entry_size

        # Geometry.
        self.virtual_size: int = virtual_size
        self.block_count: int = -(-virtual_size // BLOCK_SIZE)
        self._cluster_count = -(-virtual_size // self.cluster_size)
        self._l1_needed = -(-self._cluster_count // self.l2_entries)
        if l1_size * 8 > _MAX_L1_BYTES:
            raise self._corrupt(f"L1 table of {l1_size} entries exceeds QEMU's 32 MiB limit")
        if l1_size < self._l1_needed:
            raise self._corrupt(
                f"L1 table has {l1_size} entries but the virtual size {virtual_size} needs {self._l1_needed}"
            )
        self.l1_size: int = l1_size
        self.l1_table_offset: int = l1_offset
        if l1_size:
            self._check_table_offset(l1_offset, l1_size * 8, "L1 table")
        if refcount_clusters == 0:
            raise self._corrupt("refcount table is empty")
        self._check_table_offset(refcount_offset, 1, "refcount table")
        if nb_snapshots:
            self._check_table_offset(snapshots_offset, 1, "snapshot table")
        self.snapshot_count: int = nb_snapshots

    def _check_table_offset(self, offset: int, length: int, what: str) -> None:
        if offset == 0 or offset % self.cluster_size:
            raise self._corrupt(f"{what} offset {offset:#x} is not a non-zero multiple of the cluster size")
        if offset + length > self.file_size:
            raise self._corrupt(
                f"{what} at offset {offset:#x} ({length} bytes) lies beyond the end of the file "
                f"({self.file_size} bytes)"
            )

    def _parse_extensions(self, start: int, end: int) -> dict[int, str]:
        """Read header extensions in [start, end); returns incompatible feature names by bit."""
        available = min(end, self.file_size)
        area = (
            self._pread(start, max(0, available - start), "header extensions") if available > start else b""
        )
        feature_names: dict[int, str] = {}
        seen: set[int] = set()
        pos = 0
        while True:
            if pos + 8 > len(area):
                if start + pos + 8 <= end:
                    raise self._corrupt("header extension area is cut off by the end of the file")
                break  # no end marker but no room for another extension: accept, as QEMU does
            ext_type, ext_len = struct.unpack_from(">II", area, pos)
            if ext_type == _EXT_END:
                break
            data_start = pos + 8
            if data_start + ext_len > len(area):
                raise self._corrupt(
                    f"header extension {ext_type:#010x} ({ext_len} bytes) overruns the header area"
                )
            data = area[data_start : data_start + ext_len]
            if ext_type in seen and ext_type in (_EXT_BACKING_FORMAT, _EXT_DATA_FILE):
                raise self._corrupt(f"header extension {ext_type:#010x} appears twice")
            seen.add(ext_type)
            if ext_type == _EXT_BACKING_FORMAT:
                try:
                    self.backing_format = data.decode("ascii")
                except UnicodeDecodeError as e:
                    raise self._corrupt("backing file format name is not ASCII") from e
            elif ext_type == _EXT_FEATURE_TABLE:
                for off in range(0, len(data) - 47, 48):
                    ftype, bit = data[off], data[off + 1]
                    if ftype == 0:
                        feature_names[bit] = (
                            data[off + 2 : off + 48].split(b"\0", 1)[0].decode("ascii", "replace")
                        )
            pos = data_start + (ext_len + 7) // 8 * 8
        return feature_names

    # -- tables ------------------------------------------------------------------------------------

    def _read_l1(self) -> tuple[int, ...]:
        n = self._l1_needed  # entries beyond what the virtual size needs are never consulted
        if n == 0:
            return ()
        raw = self._pread(self.l1_table_offset, n * 8, "L1 table")
        return struct.unpack(f">{n}Q", raw)

    def _l2_offset(self, l1_index: int) -> int:
        entry = self._l1[l1_index]
        if entry & _L1_RESERVED:
            raise self._corrupt(f"L1 entry {l1_index} ({entry:#018x}) has reserved bits set")
        offset = entry & _OFFSET_MASK
        if offset:
            if offset % self.cluster_size:
                raise self._corrupt(
                    f"L1 entry {l1_index}: L2 table offset {offset:#x} is not cluster-aligned"
                )
            if offset + self.cluster_size > self.file_size:
                raise self._corrupt(
                    f"L1 entry {l1_index}: L2 table at offset {offset:#x} lies beyond the end of the file "
                    f"({self.file_size} bytes)"
                )
        return offset

    def _l2_table(self, l1_index: int) -> tuple[int, ...] | None:
        """The raw u64 words of one L2 table (pairs for extended L2), or None if unallocated."""
        with self._l2_lock:
            cached = self._l2_cache.get(l1_index)
        if cached is not None:
            return cached
        offset = self._l2_offset(l1_index)
        if not offset:
            return None
        raw = self._pread(offset, self.cluster_size, f"L2 table {l1_index}")
        words = struct.unpack(f">{self.cluster_size // 8}Q", raw)
        with self._l2_lock:
            if len(self._l2_cache) >= _L2_CACHE_TABLES:
                del self._l2_cache[next(iter(self._l2_cache))]  # oldest inserted
            self._l2_cache[l1_index] = words
        return words

    # -- mapping -----------------------------------------------------------------------------------

    def _segments(
        self, cluster: int, entry: int, bitmap: int
    ) -> Iterator[tuple[int, int, BlockKind, int | None]]:
        """(first guest block, block count, kind, host offset) for what one L2 entry allocates here.

        Counts are not yet clipped to the virtual size.
        """
        if entry & _L2_COMPRESSED:
            raise UnsupportedImageError(
                f"{self.path}: guest offset {cluster * self.cluster_size:#x} is stored as a compressed "
                "cluster, which is not supported; rewrite the image without compression "
                "('qemu-img convert -O qcow2' without -c)"
            )
        if entry & _L2_RESERVED:
            raise self._corrupt(
                f"L2 entry for guest offset {cluster * self.cluster_size:#x} ({entry:#018x}) "
                "has reserved bits set"
            )
        host = entry & _OFFSET_MASK
        if host % self.cluster_size:
            raise self._corrupt(
                f"L2 entry for guest offset {cluster * self.cluster_size:#x}: host offset {host:#x} "
                "is not cluster-aligned"
            )
        first = cluster * self.cluster_size // BLOCK_SIZE
        if not self.extended_l2:
            if entry & _L2_ZERO:
                yield first, self.cluster_size // BLOCK_SIZE, ZERO, None
            elif host:
                yield first, self.cluster_size // BLOCK_SIZE, DATA, host
            return
        alloc = bitmap & _SC_ALL
        zero = bitmap >> 32
        if alloc & zero:
            raise self._corrupt(
                f"L2 entry for guest offset {cluster * self.cluster_size:#x}: subclusters "
                f"{_bits(alloc & zero)} are marked both allocated and zero"
            )
        if alloc and not host:
            raise self._corrupt(
                f"L2 entry for guest offset {cluster * self.cluster_size:#x}: subclusters are allocated "
                "but the cluster has no host offset"
            )
        per_sc = self.subcluster_size // BLOCK_SIZE
        if alloc == _SC_ALL:
            yield first, _SUBCLUSTERS * per_sc, DATA, host
            return
        if zero == _SC_ALL:
            yield first, _SUBCLUSTERS * per_sc, ZERO, None
            return
        bits = alloc | zero
        sc = 0
        while bits:
            if not bits & 1:
                skip = (bits & -bits).bit_length() - 1
                bits >>= skip
                sc += skip
                continue
            if alloc >> sc & 1:
                yield first + sc * per_sc, per_sc, DATA, host + sc * self.subcluster_size
            else:
                yield first + sc * per_sc, per_sc, ZERO, None
            bits >>= 1
            sc += 1

    def _all_segments(self) -> Iterator[tuple[int, int, BlockKind, int | None]]:
        """Segments of every allocated cluster in guest order, clipped to the virtual size and checked."""
        ext = self.extended_l2
        per_table = self.l2_entries
        last_block = self.block_count
        for l1_index in range(self._l1_needed):
            table = self._l2_table(l1_index)
            if table is None:
                continue
            base = l1_index * per_table
            n = min(per_table, self._cluster_count - base)
            for i in range(n):
                if ext:
                    entry, bitmap = table[2 * i], table[2 * i + 1]
                    if not entry and not bitmap:
                        continue
                else:
                    entry, bitmap = table[i], 0
                    if not entry:
                        continue
                for start, count, kind, host in self._segments(base + i, entry, bitmap):
                    if start >= last_block:
                        continue
                    if start + count > last_block:
                        count = last_block - start
                    if host is not None:
                        self._check_data(start, count, host)
                    yield start, count, kind, host

    def _guest_bytes(self, start: int, count: int) -> int:
        """Bytes of guest data in blocks [start, start+count) (the last block may be short)."""
        return min((start + count) * BLOCK_SIZE, self.virtual_size) - start * BLOCK_SIZE

    def _check_data(self, start: int, count: int, host: int) -> None:
        end = host + self._guest_bytes(start, count)
        if end > self.file_size:
            raise self._corrupt(
                f"data for guest offset {start * BLOCK_SIZE:#x} at host offset {host:#x} lies beyond "
                f"the end of the file ({self.file_size} bytes)"
            )

    # -- public iteration --------------------------------------------------------------------------

    def own_records(self, progress: Callable[[int, int], None] | None = None) -> bytes | None:
        """The manifest records of every block this file allocates (``index << 1 | zero`` and hash, in
        guest order; allocated blocks of zeros flagged as zero): per L2 table, the table walked and its
        data read and hashed by the extension on every core. None if a table or its data is anything
        :meth:`iter_block_runs` refuses; the caller then takes that path, which names what is wrong.
        An L1 entry that is wrong raises here as it does there."""
        parts: list[bytes] = []
        for l1_index in range(self._l1_needed):
            offset = self._l2_offset(l1_index)
            if not offset:
                continue
            raw = self._pread(offset, self.cluster_size, f"L2 table {l1_index}")
            base = l1_index * self.l2_entries
            n = min(self.l2_entries, self._cluster_count - base)
            got = native.layer_table_records(self._fd, raw, base, n, self.extended_l2, self.cluster_size,
                                             self.subcluster_size, self.block_count, self.virtual_size,
                                             self.file_size)
            if got is None:
                return None
            parts.append(got)
            if progress is not None:
                progress(min((base + n) * self.cluster_size, self.virtual_size), self.virtual_size)
        return b"".join(parts)

    def iter_block_runs(self, max_blocks: int = 2048) -> Iterator[BlockRun]:
        """Runs of blocks allocated in this file, in guest order, each at most ``max_blocks`` long.

        Adjacent DATA blocks that are also adjacent in the file are merged into one run (so one
        pread can fetch them), as are adjacent ZERO blocks. Blocks not covered by any run are not
        allocated in this file and fall through to the backing file.
        """
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        cur_start = cur_count = 0
        cur_kind: BlockKind | None = None
        cur_host: int | None = None
        for start, count, kind, host in self._all_segments():
            if (
                kind is cur_kind
                and start == cur_start + cur_count
                and (host is None or cur_host is not None and host == cur_host + cur_count * BLOCK_SIZE)
            ):
                cur_count += count
            else:
                if cur_kind is not None:
                    yield from _split(cur_start, cur_count, cur_kind, cur_host, max_blocks)
                cur_start, cur_count, cur_kind, cur_host = start, count, kind, host
                continue
            if cur_count >= max_blocks:
                # Emit full pieces now so memory stays bounded on huge contiguous images.
                full = cur_count - cur_count % max_blocks
                yield from _split(cur_start, full, cur_kind, cur_host, max_blocks)
                cur_start += full
                cur_count -= full
                if cur_host is not None:
                    cur_host += full * BLOCK_SIZE
                if cur_count == 0:
                    cur_kind = None
        if cur_kind is not None:
            yield from _split(cur_start, cur_count, cur_kind, cur_host, max_blocks)

    def iter_blocks(self) -> Iterator[tuple[int, BlockKind, int | None]]:
        """``(block_index, kind, host_offset)`` for every 4 KiB block allocated in this file only."""
        for run in self.iter_block_runs():
            if run.host_offset is None:
                for i in range(run.start, run.start + run.count):
                    yield i, ZERO, None
            else:
                host = run.host_offset - run.start * BLOCK_SIZE
                for i in range(run.start, run.start + run.count):
                    yield i, DATA, host + i * BLOCK_SIZE

    def block_kind(self, index: int) -> tuple[BlockKind, int | None] | None:
        """``(kind, host_offset)`` of one block, or None if this file does not allocate it."""
        if not 0 <= index < self.block_count:
            raise IndexError(f"block {index} outside a disk of {self.block_count} blocks")
        cluster = index * BLOCK_SIZE // self.cluster_size
        l1_index, i = divmod(cluster, self.l2_entries)
        table = self._l2_table(l1_index)
        if table is None:
            return None
        if self.extended_l2:
            entry, bitmap = table[2 * i], table[2 * i + 1]
        else:
            entry, bitmap = table[i], 0
        for start, count, kind, host in self._segments(cluster, entry, bitmap):
            if start <= index < start + count:
                if host is None:
                    return kind, None
                host += (index - start) * BLOCK_SIZE
                self._check_data(index, 1, host)
                return kind, host
        return None

    def read_block(self, index: int) -> bytes | None:
        """Guest content of one block as this file defines it (zero-padded to 4 KiB at the disk's end),
        or None if the block is not allocated here (it falls through to the backing file)."""
        found = self.block_kind(index)
        if found is None:
            return None
        kind, host = found
        if host is None:
            return bytes(BLOCK_SIZE)
        n = self._guest_bytes(index, 1)
        data = self._pread(host, n, f"data of block {index}")
        return data if n == BLOCK_SIZE else data + bytes(BLOCK_SIZE - n)

    def read_run_into(self, run: BlockRun, buf: bytearray | memoryview) -> memoryview:
        """Read a run's guest content into ``buf``; returns the ``run.count * BLOCK_SIZE`` byte view."""
        size = run.count * BLOCK_SIZE
        view = memoryview(buf).cast("B")
        if len(view) < size:
            raise ValueError(f"buffer of {len(view)} bytes too small for a run of {run.count} blocks")
        view = view[:size]
        if run.host_offset is None:
            view[:] = bytes(size)
            return view
        n = self._guest_bytes(run.start, run.count)
        self._preadinto(view[:n], run.host_offset, f"data of blocks {run.start}..{run.start + run.count - 1}")
        if n < size:
            view[n:] = bytes(size - n)
        return view

    def read_run(self, run: BlockRun) -> bytes:
        """A run's guest content as bytes (``run.count * BLOCK_SIZE`` long)."""
        buf = bytearray(run.count * BLOCK_SIZE)
        self.read_run_into(run, buf)
        return bytes(buf)


def _split(start: int, count: int, kind: BlockKind, host: int | None, max_blocks: int) -> Iterator[BlockRun]:
    while count > 0:
        n = min(count, max_blocks)
        yield BlockRun(start, n, kind, host)
        start += n
        count -= n
        if host is not None:
            host += n * BLOCK_SIZE


def _bits(mask: int) -> str:
    return ",".join(str(b) for b in range(mask.bit_length()) if mask >> b & 1)
