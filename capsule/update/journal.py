"""The ext4 journal's blocks an update wrote, dropped from its new layer after a clean shutdown.

Every update writes its metadata through the ext4 journal (jbd2: inode 8, a fixed ring of blocks made by
``mkfs``), so a new layer holds each journal block the run used: 13–57 % of the layer's data in B1. After
the guest's *clean* shutdown those contents are dead: the unmount checkpointed every transaction into the
file system proper and wrote the journal's superblock (its first block) with ``s_start = 0`` ("nothing to
replay") and ``s_sequence`` the next transaction id. So, before the leaf is sealed, every block of the
journal except that first one is dropped from the leaf (its records removed, as ``capsule.lifecycle.compact`` drops
zero marks): the parent's older journal blocks show through instead. That is safe:

- jbd2 recovery (the kernel's at mount, e2fsck's) only runs when the journal superblock's ``s_start`` is
  not 0; the kept superblock says 0, so nothing in the ring is read at the next mount;
- when a later run of the version crashes, recovery starts at ``s_start`` expecting ``s_sequence`` and
  stops at the first block that is not a descriptor/commit of the expected next sequence number. The
  transactions that run writes carry ``s_sequence`` and up; every block showing through from the parent
  was written by an earlier run of an ancestor and carries an older sequence number (sequences only grow
  along a chain: each child boots from its parent's journal superblock), so recovery never takes one
  for a transaction of its own — the same situation as the stale blocks any journal ring holds.

Only done when it can be proved on the sealed-to-be disk itself (read through the leaf and its chain): an
ext4 file system with 4 KiB blocks, an internal journal in inode 8, the ``needs_recovery`` flag clear and
the journal superblock (at the first listed block, its magic checked) saying ``s_start = 0``. Anything
else (a forced power-off, another file system, an external journal, a partition not 4 KiB-aligned) drops
nothing. The block list itself comes from the guest before the shutdown (``debugfs -c`` read-only on the
root device; the journal's blocks never move after ``mkfs``)."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hashcache.blocks import BLOCK_SIZE
from hashcache.qcow2 import Qcow2Image

EXT4_MAGIC = 0xEF53
JBD2_MAGIC = 0xC03B3998
INCOMPAT_RECOVER = 0x4          # ext4 s_feature_incompat: the journal needs recovery
INCOMPAT_JOURNAL_DEV = 0x8      # this file system *is* an external journal
COMPAT_HAS_JOURNAL = 0x4
JOURNAL_INODE = 8

# the guest side: root device, its partition start (512-byte sectors, 0 if a whole disk), debugfs output
GUEST_SCRIPT = (
    "dev=$(findmnt -no SOURCE /); name=${dev##*/}; disk=$name; start=0; "
    "if [ -e /sys/class/block/$name/partition ]; then start=$(cat /sys/class/block/$name/start); "
    "disk=$(basename \"$(readlink -f /sys/class/block/$name/..)\"); fi; "
    "echo \"device $dev disk $disk start $start\"; "
    "debugfs -c -R 'stats -h' \"$dev\" 2>/dev/null; debugfs -c -R 'stat <8>' \"$dev\" 2>/dev/null; true")

_EXTENT = re.compile(r"\((\d+)(?:-(\d+))?\):(\d+)(?:-(\d+))?")
_HEAD = re.compile(r"^device (\S+) disk (\S+) start (\d+)$", re.M)

ReadBlock = Callable[[int], "bytes | None"]


@dataclass(frozen=True)
class JournalMap:
    """Where an ext4 journal sits on one disk of the guest."""

    disk: int                  # the disk's index (vda → 0, vdb → 1, …)
    first_block: int           # the file system's block 0 as a 4 KiB block of the disk (partition start)
    blocks: tuple[int, ...]    # the journal's file-system blocks in logical order; [0] is its superblock

    @property
    def superblock(self) -> int:
        """The disk block of the journal's superblock (kept)."""
        return self.first_block + self.blocks[0]

    def droppable(self) -> set[int]:
        """Disk blocks of the journal but its superblock."""
        return {self.first_block + b for b in self.blocks[1:]}


def extents(stat_text: str) -> list[tuple[int, int, int]]:
    """``(logical start, count, physical start)`` of each extent debugfs ``stat`` printed after
    ``EXTENTS:`` (index blocks, ``(ETB0):123``, are not journal data and are skipped)."""
    _, sep, tail = stat_text.partition("EXTENTS:")
    if not sep:
        return []
    out = []
    for m in _EXTENT.finditer(tail):
        lo, hi, p_lo, p_hi = m.group(1), m.group(2), m.group(3), m.group(4)
        count = int(hi or lo) - int(lo) + 1
        if int(p_hi or p_lo) - int(p_lo) + 1 != count:
            raise ValueError(f"extent {m.group(0)!r}: logical and physical lengths differ")
        out.append((int(lo), count, int(p_lo)))
    return out


def logical_blocks(parts: list[tuple[int, int, int]]) -> tuple[int, ...]:
    """The physical blocks in logical order; ValueError if the logical range has holes or overlaps."""
    parts = sorted(parts)
    expect = 0
    blocks: list[int] = []
    for lo, count, phys in parts:
        if lo != expect:
            raise ValueError(f"the journal's logical blocks jump from {expect} to {lo}")
        blocks.extend(range(phys, phys + count))
        expect = lo + count
    return tuple(blocks)


def disk_index(name: str) -> int | None:
    """``vda`` → 0, ``vdb`` → 1, … (``sdX``/``xvdX`` too); None for anything else."""
    m = re.fullmatch(r"(?:vd|sd|xvd)([a-z])", name)
    return ord(m.group(1)) - ord("a") if m else None


def parse_guest(text: str) -> JournalMap | None:
    """The journal map from ``GUEST_SCRIPT``'s output, or None when it is not an internal journal in
    inode 8 of an ext4 file system with 4 KiB blocks on a 4 KiB-aligned whole disk or partition."""
    head = _HEAD.search(text)
    if head is None:
        return None
    disk = disk_index(head.group(2))
    start_bytes = int(head.group(3)) * 512
    if disk is None or start_bytes % BLOCK_SIZE:
        return None

    def field(label: str) -> str | None:
        m = re.search(rf"^{label}:\s*(.*)$", text, re.M)
        return m.group(1).strip() if m else None

    features = (field("Filesystem features") or "").split()
    if (field("Filesystem magic number") or "").lower() != "0xef53" or field("Block size") != "4096" \
            or field("Journal inode") != str(JOURNAL_INODE) or "has_journal" not in features \
            or "extent" not in features or field("Journal device") is not None:
        return None
    try:
        blocks = logical_blocks(extents(text))
    except ValueError:
        return None
    if len(blocks) < 2:
        return None
    return JournalMap(disk, start_bytes // BLOCK_SIZE, blocks)


def clean(jmap: JournalMap, read_block: ReadBlock) -> bool:
    """Whether the disk as ``read_block`` (disk block → 4 KiB, None for unreadable) shows that journal
    shut cleanly: the ext4 superblock (4 KiB blocks, journal inode 8, internal, no recovery needed) and the
    jbd2 superblock at the map's first block (its magic, ``s_start`` 0)."""
    sb0 = read_block(jmap.first_block)
    jsb = read_block(jmap.superblock)
    if sb0 is None or jsb is None:
        return False
    sb = sb0[1024:2048]
    magic, = struct.unpack_from("<H", sb, 0x38)
    log_block, = struct.unpack_from("<I", sb, 0x18)
    compat, incompat = struct.unpack_from("<II", sb, 0x5C)
    journal_inum, journal_dev = struct.unpack_from("<II", sb, 0xE0)
    if magic != EXT4_MAGIC or 1024 << log_block != BLOCK_SIZE or not compat & COMPAT_HAS_JOURNAL \
            or incompat & (INCOMPAT_RECOVER | INCOMPAT_JOURNAL_DEV) or journal_inum != JOURNAL_INODE \
            or journal_dev != 0:
        return False
    j_magic, = struct.unpack_from(">I", jsb, 0)
    s_start, = struct.unpack_from(">I", jsb, 0x1C)
    return j_magic == JBD2_MAGIC and s_start == 0


def chain_reader(leaf: Path, below: list[Path]) -> ReadBlock:
    """Read a disk block as the guest would: the leaf's own, else the chain's top first (``below``,
    top first); a block no file holds reads as zero; None when a layer file is not here (a remote one)."""
    def read(index: int) -> bytes | None:
        for path in [leaf, *below]:
            if not path.exists():
                return None
            with Qcow2Image(path) as img:
                if index >= img.block_count:
                    return None
                data = img.read_block(index)
            if data is not None:
                return data
        return bytes(BLOCK_SIZE)
    return read


def releaser(jmap: JournalMap | None, layer_path: Callable[[str], Path],
             say: Callable[[str], None]) -> Callable[[int, Path, list[str]], set[int]]:
    """The ``release`` callable of ``lifecycle.stop`` for an update: on the journal's disk, its blocks but
    the superblock, when the disk read through the leaf and its chain shows the journal shut cleanly."""
    def release(disk: int, leaf: Path, chain: list[str]) -> set[int]:
        if jmap is None or disk != jmap.disk:
            return set()
        if not clean(jmap, chain_reader(leaf, [layer_path(lid) for lid in reversed(chain)])):
            say("the ext4 journal was not shut cleanly: its blocks stay in the layer")
            return set()
        return jmap.droppable()
    return release
