"""capsule.update.journal: the ext4 journal's blocks as the guest's debugfs names them, and the proof on
the disk itself (ext4 and jbd2 superblocks) that the journal was shut cleanly before any is dropped."""

from __future__ import annotations

import struct

import pytest

from capsule.update.journal import (
    JBD2_MAGIC,
    JournalMap,
    clean,
    disk_index,
    extents,
    logical_blocks,
    parse_guest,
)

pytestmark = pytest.mark.unit

STATS = """Filesystem volume name:   capsule-root
Filesystem magic number:  0xEF53
Filesystem features:      has_journal ext_attr resize_inode dir_index filetype extent 64bit flex_bg
Block size:               4096
Journal inode:            8
Journal backup:           inode blocks
"""
STAT8 = """Inode: 8   Type: regular    Mode:  0600   Flags: 0x80000
Size of extra inode fields: 32
EXTENTS:
(ETB0):1000, (0-3):262144-262147, (4):9000, (5-7):262149-262151
"""


def guest(head: str = "device /dev/vda disk vda start 0", stats: str = STATS, stat8: str = STAT8) -> str:
    return f"{head}\n{stats}{stat8}"


def test_extents_in_logical_order_skip_index_blocks():
    assert extents(STAT8) == [(0, 4, 262144), (4, 1, 9000), (5, 3, 262149)]
    assert logical_blocks(extents(STAT8)) == (262144, 262145, 262146, 262147, 9000, 262149, 262150, 262151)
    with pytest.raises(ValueError, match="jump"):
        logical_blocks([(0, 2, 10), (3, 1, 50)])
    with pytest.raises(ValueError, match="lengths differ"):
        extents("EXTENTS:\n(0-3):10-11\n")


def test_a_whole_disk_journal_map():
    jmap = parse_guest(guest())
    assert jmap == JournalMap(0, 0, (262144, 262145, 262146, 262147, 9000, 262149, 262150, 262151))
    assert jmap.superblock == 262144
    assert jmap.droppable() == {262145, 262146, 262147, 9000, 262149, 262150, 262151}


def test_a_partition_shifts_the_blocks():
    jmap = parse_guest(guest("device /dev/vdb1 disk vdb start 2048"))
    assert jmap is not None and jmap.disk == 1 and jmap.first_block == 256
    assert jmap.superblock == 256 + 262144 and 256 + 9000 in jmap.droppable()


@pytest.mark.parametrize("text", [
    guest("device /dev/vda1 disk vda start 63"),                       # not 4 KiB-aligned
    guest("device /dev/mapper/root disk dm-0 start 0"),                # not a disk we map to an index
    guest(stats=STATS.replace("4096", "1024")),                        # 1 KiB blocks
    guest(stats=STATS.replace("Journal inode:            8", "Journal inode:            12")),
    guest(stats=STATS + "Journal device:	0x0803\n"),                 # an external journal
    guest(stats=STATS.replace("has_journal ", "")),                    # ext2
    guest(stats=STATS.replace("0xEF53", "0x1234")),
    guest(stat8="Inode: 8\nEXTENTS:\n(0-3):10-13, (5-6):20-21\n"),    # a hole: not the journal we know
    guest(stat8="Inode: 8\nBLOCKS:\n(0-3):10-13\n"),                   # no extents
    "debugfs: command not found\n",
])
def test_anything_else_drops_nothing(text):
    assert parse_guest(text) is None


def test_disk_index():
    assert [disk_index(n) for n in ("vda", "vdc", "sdb", "xvda", "nvme0n1", "vda1")] == [0, 2, 1, 0, None, None]


def ext4_block0(*, incompat: int = 0x2C0, log_block: int = 2, inum: int = 8, dev: int = 0) -> bytes:
    sb = bytearray(1024)
    struct.pack_into("<I", sb, 0x18, log_block)
    struct.pack_into("<H", sb, 0x38, 0xEF53)
    struct.pack_into("<III", sb, 0x5C, 0x3C, incompat, 0x7B)
    struct.pack_into("<II", sb, 0xE0, inum, dev)
    return bytes(1024) + bytes(sb) + bytes(2048)


def jbd2_sb(*, start: int = 0, magic: int = JBD2_MAGIC, sequence: int = 77) -> bytes:
    b = bytearray(4096)
    struct.pack_into(">III", b, 0, magic, 4, 0)
    struct.pack_into(">IIIII", b, 0x0C, 4096, 16384, 1, sequence, start)
    return bytes(b)


def test_clean_reads_both_superblocks():
    jmap = JournalMap(0, 0, (500, 501, 502))

    def disk(block0: bytes, jsb: bytes | None):
        return lambda i: {0: block0, 500: jsb}.get(i, bytes(4096))

    assert clean(jmap, disk(ext4_block0(), jbd2_sb()))
    assert not clean(jmap, disk(ext4_block0(), jbd2_sb(start=1)))                # transactions to replay
    assert not clean(jmap, disk(ext4_block0(), jbd2_sb(magic=0)))                 # not the journal's head
    assert not clean(jmap, disk(ext4_block0(incompat=0x2C4), jbd2_sb()))          # needs_recovery
    assert not clean(jmap, disk(ext4_block0(log_block=0), jbd2_sb()))             # 1 KiB blocks
    assert not clean(jmap, disk(ext4_block0(inum=12), jbd2_sb()))
    assert not clean(jmap, disk(ext4_block0(dev=0x803), jbd2_sb()))               # external journal
    assert not clean(jmap, disk(ext4_block0(), None))                             # a remote layer
    shifted = JournalMap(0, 256, (500, 501))
    assert clean(shifted, lambda i: {256: ext4_block0(), 756: jbd2_sb()}.get(i, bytes(4096)))
