"""Write a qcow2 layer from a manifest's records and the data of its non-zero blocks.

The inverse of :func:`hashcache.manifest.manifest_of_layer`: given the ``(block_index, is_zero)``
records of a layer manifest and a way to read each non-zero block, :func:`write_layer` writes a
qcow2 v3 file (``cluster_size=131072,extended_l2=on``, 16-bit refcounts) whose layer manifest is
exactly those records, so its digest equals the source manifest's.

Mapping of records to extended L2 entries (one 4 KiB subcluster per block):

* a guest cluster holding at least one non-zero block gets one host cluster; its non-zero blocks
  are written at their subcluster positions and flagged allocated, the other subclusters are left
  as holes in the (sparse) file;
* zero-flagged blocks get the subcluster "zero" bit (in a cluster without data the standard entry
  stays 0: no host cluster, which extended L2 allows);
* blocks not listed get neither bit and fall through to the backing file.

File layout, in clusters of 128 KiB (one pass, so the data can be streamed)::

    0            header, header extensions, backing file name
    1 ..         L1 table (absent when the virtual size is 0)
    ..           data clusters, in guest order
    ..           L2 tables, in guest order
    ..           refcount table, then refcount blocks (every cluster of the file has refcount 1)

Every structure is cluster-aligned; every allocated cluster has refcount exactly 1 and the COPIED
flag in the L1/L2 entry pointing at it, so ``qemu-img check`` finds no errors or leaks and QEMU can
use the file read-write (e.g. ``qemu-img commit`` into it) or as a backing file.
"""

from __future__ import annotations

import operator
import os
import struct
from array import array
from collections.abc import Callable, Iterable
from pathlib import Path

from hashcache.atomic import pwrite_all
from hashcache.blocks import BLOCK_SIZE

CLUSTER_BITS = 17
CLUSTER_SIZE = 1 << CLUSTER_BITS
SUBCLUSTERS = 32
SUBCLUSTER_SIZE = CLUSTER_SIZE // SUBCLUSTERS
BLOCKS_PER_CLUSTER = CLUSTER_SIZE // BLOCK_SIZE
L2_ENTRY_SIZE = 16  # extended L2: 8-byte standard entry + 8-byte subcluster bitmap
L2_ENTRIES = CLUSTER_SIZE // L2_ENTRY_SIZE  # 8192: one L2 table maps 1 GiB
REFCOUNT_ORDER = 4  # 16-bit refcounts
REFCOUNTS_PER_BLOCK = CLUSTER_SIZE * 8 >> REFCOUNT_ORDER  # 65536: one refcount block covers 8 GiB
REFTABLE_ENTRIES_PER_CLUSTER = CLUSTER_SIZE // 8
HEADER_LENGTH = 112  # 104-byte v3 header + compression type byte + 7 bytes padding
MAX_BACKING_NAME = 1023  # QEMU refuses longer backing file names
MAX_L1_BYTES = 32 * 1024 * 1024  # QEMU's limit on the L1 table
SECTOR_SIZE = 512

assert SUBCLUSTER_SIZE == BLOCK_SIZE  # one manifest block <-> one subcluster

MAGIC = b"QFI\xfb"
VERSION = 3
INCOMPAT_EXTENDED_L2 = 1 << 4
EXT_END = 0x00000000
EXT_BACKING_FORMAT = 0xE2792ACA
EXT_FEATURE_TABLE = 0x6803F857

COPIED = 1 << 63  # L1/L2 entry flag: the cluster's refcount is exactly 1

#: The feature name table QEMU writes (type: 0 incompatible, 1 compatible, 2 autoclear; bit; name).
_FEATURE_NAMES: tuple[tuple[int, int, bytes], ...] = (
    (0, 0, b"dirty bit"),
    (0, 1, b"corrupt bit"),
    (0, 2, b"external data file"),
    (0, 3, b"compression type"),
    (0, 4, b"extended L2 entries"),
    (1, 0, b"lazy refcounts"),
    (2, 0, b"bitmaps"),
    (2, 1, b"raw external data"),
)

# Header fields up to header_length (offsets 0..103), then compression_type (104) and padding.
_HEADER = struct.Struct(
    ">4s"  # 0   magic
    "I"  # 4   version
    "Q"  # 8   backing_file_offset
    "I"  # 16  backing_file_size
    "I"  # 20  cluster_bits
    "Q"  # 24  size
    "I"  # 32  crypt_method
    "I"  # 36  l1_size
    "Q"  # 40  l1_table_offset
    "Q"  # 48  refcount_table_offset
    "I"  # 56  refcount_table_clusters
    "I"  # 60  nb_snapshots
    "Q"  # 64  snapshots_offset
    "Q"  # 72  incompatible_features
    "Q"  # 80  compatible_features
    "Q"  # 88  autoclear_features
    "I"  # 96  refcount_order
    "I"  # 100 header_length
    "B"  # 104 compression_type (0 = zlib)
    "7x"  # 105 padding to a multiple of 8
)
assert _HEADER.size == HEADER_LENGTH

_L2_PAIR = struct.Struct(">QQ")
_EXT_HEADER = struct.Struct(">II")

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)`` in guest bytes, as for ``manifest_of_layer``."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def refcount_layout(used_clusters: int) -> tuple[int, int]:
    """``(reftable_clusters, refcount_blocks)`` needed when the refcount structures are appended after
    ``used_clusters`` clusters: the refcount blocks must also cover the reftable and themselves."""
    if used_clusters < 0:
        raise ValueError(f"used_clusters {used_clusters} is negative")
    blocks = 0
    table = 0
    while True:
        total = used_clusters + table + blocks
        need_blocks = _ceil_div(total, REFCOUNTS_PER_BLOCK)
        need_table = max(1, _ceil_div(need_blocks, REFTABLE_ENTRIES_PER_CLUSTER))
        if need_blocks == blocks and need_table == table:
            return table, blocks
        blocks, table = max(blocks, need_blocks), max(table, need_table)


def _header_cluster(
    *, virtual_size: int, backing: str | None, l1_size: int, l1_offset: int, reftable_offset: int,
    reftable_clusters: int,
) -> bytes:  # fmt: skip
    """Cluster 0 up to the end of the backing file name: header, extensions, name."""
    ext = bytearray()

    def add_extension(ext_type: int, data: bytes) -> None:
        ext.extend(_EXT_HEADER.pack(ext_type, len(data)))
        ext.extend(data)
        ext.extend(bytes(-len(data) % 8))

    if backing is not None:
        add_extension(EXT_BACKING_FORMAT, b"qcow2")
    add_extension(
        EXT_FEATURE_TABLE,
        b"".join(struct.pack(">BB46s", kind, bit, name) for kind, bit, name in _FEATURE_NAMES),
    )
    ext.extend(_EXT_HEADER.pack(EXT_END, 0))

    name = backing.encode() if backing is not None else b""
    backing_offset = HEADER_LENGTH + len(ext) if backing is not None else 0
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        backing_offset,
        len(name),
        CLUSTER_BITS,
        virtual_size,
        0,  # crypt_method: none
        l1_size,
        l1_offset,
        reftable_offset,
        reftable_clusters,
        0,  # nb_snapshots
        0,  # snapshots_offset
        INCOMPAT_EXTENDED_L2,
        0,  # compatible_features
        0,  # autoclear_features
        REFCOUNT_ORDER,
        HEADER_LENGTH,
        0,  # compression_type: zlib (never used: nothing is compressed)
    )
    out = header + bytes(ext) + name
    assert len(out) <= CLUSTER_SIZE
    return out


def _check_backing(backing: str | None) -> None:
    if backing is None:
        return
    if not isinstance(backing, str) or not backing:
        raise ValueError(f"backing file name {backing!r} must be a non-empty string (or None)")
    if "\0" in backing:
        raise ValueError(f"backing file name {backing!r} contains a NUL byte")
    if len(backing.encode()) > MAX_BACKING_NAME:
        raise ValueError(f"backing file name is longer than {MAX_BACKING_NAME} bytes (QEMU's limit)")


def write_layer(
    out: Path,
    *,
    virtual_size: int,
    backing: str | None,
    records: Iterable[tuple[int, bool]],
    read_block: Callable[[int], bytes],
    progress: Progress | None = None,
) -> None:
    """Write ``out`` as a qcow2 layer defining exactly the blocks in ``records``.

    ``records`` are a layer manifest's ``(block_index, is_zero)`` pairs in strictly ascending block
    order (e.g. ``((i, z) for i, z, _ in manifest.records())``); blocks not listed fall through to
    the backing file. ``read_block(index)`` must return the 4096 bytes of each non-zero block; it is
    called exactly once per non-zero block, in ascending order, interleaved with the iteration of
    ``records``. The last block of a virtual size that is not a multiple of 4 KiB is still 4096
    bytes (zero-padded, as it is hashed); its bytes beyond the disk's end are stored as zeros
    whatever they are. The returned buffer is copied before the next call, so the caller may reuse
    it.

    ``backing`` is stored verbatim as the backing file name (QEMU resolves a relative name against
    the directory of ``out``), with backing format ``qcow2``; None writes a root layer.

    ``out`` is created or truncated and fsynced at the end (not its directory: the caller writes
    a temporary name and renames). Invalid input raises ValueError, possibly after part of ``out``
    has been written; the caller then discards the file. ``progress(done, total)`` reports guest
    bytes covered so far out of ``virtual_size``.
    """
    if type(virtual_size) is not int or virtual_size < 0 or virtual_size % SECTOR_SIZE:
        raise ValueError(
            f"virtual size {virtual_size!r} must be a non-negative multiple of {SECTOR_SIZE} "
            "(QEMU rounds other sizes down)"
        )
    _check_backing(backing)
    block_count = _ceil_div(virtual_size, BLOCK_SIZE)
    last_block, tail = block_count - 1, virtual_size % BLOCK_SIZE
    guest_clusters = _ceil_div(virtual_size, CLUSTER_SIZE)
    l1_size = _ceil_div(guest_clusters, L2_ENTRIES)
    if l1_size * 8 > MAX_L1_BYTES:
        raise ValueError(f"virtual size {virtual_size} needs an L1 table larger than QEMU's 32 MiB limit")
    l1_clusters = _ceil_div(l1_size * 8, CLUSTER_SIZE)
    l1_offset = CLUSTER_SIZE if l1_size else 0

    fd = os.open(os.fspath(out), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        next_cluster = 1 + l1_clusters
        # One entry per guest cluster this layer defines anything in, in guest order.
        l2_clusters = array("Q")  # guest cluster index
        l2_words = array("Q")  # standard entry (host offset | COPIED, or 0)
        l2_bitmaps = array("Q")  # zero bits << 32 | allocation bits

        buf = bytearray(CLUSTER_SIZE)  # data of the current guest cluster
        view = memoryview(buf)
        cur = -1
        alloc = zero = 0
        prev = -1

        def flush() -> None:
            nonlocal next_cluster
            if cur < 0 or not (alloc | zero):
                return
            host = 0
            if alloc:
                host = next_cluster * CLUSTER_SIZE
                next_cluster += 1
                bits, sc = alloc, 0
                while bits:  # one write per run of consecutive data subclusters
                    if not bits & 1:
                        skip = (bits & -bits).bit_length() - 1
                        bits >>= skip
                        sc += skip
                        continue
                    run = (~bits & (bits + 1)).bit_length() - 1  # number of trailing one bits
                    start = sc * SUBCLUSTER_SIZE
                    pwrite_all(fd, view[start : start + run * SUBCLUSTER_SIZE], host + start)
                    bits >>= run
                    sc += run
            l2_clusters.append(cur)
            l2_words.append(host | COPIED if host else 0)
            l2_bitmaps.append(zero << 32 | alloc)
            if progress is not None:
                progress(min((cur + 1) * CLUSTER_SIZE, virtual_size), virtual_size)

        for index, is_zero in records:
            index = operator.index(index)
            if index < 0 or index >= block_count:
                raise ValueError(
                    f"record for block {index} lies outside a virtual size of {virtual_size} bytes "
                    f"({block_count} blocks)"
                )
            if index <= prev:
                raise ValueError(f"records are not in strictly ascending block order: block {index} after block {prev}")
            prev = index
            cluster, sc = divmod(index, BLOCKS_PER_CLUSTER)
            if cluster != cur:
                flush()
                cur, alloc, zero = cluster, 0, 0
            if is_zero:
                zero |= 1 << sc
                continue
            data = memoryview(read_block(index)).cast("B")
            if len(data) != BLOCK_SIZE:
                raise ValueError(f"read_block({index}) returned {len(data)} bytes, expected {BLOCK_SIZE}")
            start = sc * BLOCK_SIZE
            view[start : start + BLOCK_SIZE] = data
            if index == last_block and tail:
                view[start + tail : start + BLOCK_SIZE] = bytes(BLOCK_SIZE - tail)  # beyond the disk's end
            alloc |= 1 << sc
        flush()

        # L2 tables, one per 1 GiB of guest space that has any entry.
        l1 = array("Q", bytes(8 * l1_size))
        table = bytearray(CLUSTER_SIZE)
        i, n = 0, len(l2_clusters)
        while i < n:
            l1_index = l2_clusters[i] // L2_ENTRIES
            base = l1_index * L2_ENTRIES
            table[:] = bytes(CLUSTER_SIZE)
            while i < n and l2_clusters[i] // L2_ENTRIES == l1_index:
                _L2_PAIR.pack_into(table, (l2_clusters[i] - base) * L2_ENTRY_SIZE, l2_words[i], l2_bitmaps[i])
                i += 1
            offset = next_cluster * CLUSTER_SIZE
            next_cluster += 1
            pwrite_all(fd, table, offset)
            l1[l1_index] = offset | COPIED
        if l1_size:
            pwrite_all(fd, struct.pack(f">{l1_size}Q", *l1), l1_offset)

        # Refcount table and blocks, appended; every cluster of the file has refcount 1.
        reftable_clusters, refblocks = refcount_layout(next_cluster)
        reftable_offset = next_cluster * CLUSTER_SIZE
        first_refblock = next_cluster + reftable_clusters
        total = first_refblock + refblocks
        reftable = struct.pack(f">{refblocks}Q", *((first_refblock + k) * CLUSTER_SIZE for k in range(refblocks)))
        pwrite_all(fd, reftable + bytes(reftable_clusters * CLUSTER_SIZE - len(reftable)), reftable_offset)
        full_block = b"\x00\x01" * REFCOUNTS_PER_BLOCK
        for k in range(refblocks):
            covered = min(REFCOUNTS_PER_BLOCK, total - k * REFCOUNTS_PER_BLOCK)
            block = (
                full_block
                if covered == REFCOUNTS_PER_BLOCK
                else full_block[: 2 * covered] + bytes(2 * (REFCOUNTS_PER_BLOCK - covered))
            )
            pwrite_all(fd, block, (first_refblock + k) * CLUSTER_SIZE)

        pwrite_all(
            fd,
            _header_cluster(
                virtual_size=virtual_size,
                backing=backing,
                l1_size=l1_size,
                l1_offset=l1_offset,
                reftable_offset=reftable_offset,
                reftable_clusters=reftable_clusters,
            ),
            0,
        )
        os.fsync(fd)
    finally:
        os.close(fd)
    if progress is not None:
        progress(virtual_size, virtual_size)
