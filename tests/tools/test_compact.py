"""capsule.lifecycle.compact: zero marks a discard leaves over blocks the parent chain already reads as zero are
dropped; the guest's view of the chain is unchanged (checked by qemu-img compare), and zero marks over the
parent's data stay."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from capsule.lifecycle.compact import chain_nonzero, drop_covered_zeros
from hashcache.blocks import BLOCK_SIZE
from hashcache.manifest import Manifest, manifest_of_layer

pytestmark = pytest.mark.tools

OPTS = "cluster_size=131072,extended_l2=on"
MiB = 1 << 20


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def io(path: Path, cmd: str) -> None:
    sh("qemu-io", "-f", "qcow2", "-c", cmd, str(path))


def test_discarded_clusters_over_zero_parent_blocks_are_dropped(tmp_path):
    root = tmp_path / ("ab" * 32 + ".qcow2")
    sh("qemu-img", "create", "-q", "-f", "qcow2", "-o", OPTS, str(root), "8M")
    io(root, "write -P 0x11 0 1M")                 # the parent holds data in its first MiB only
    leaf = tmp_path / "leaf.qcow2"
    sh("qemu-img", "create", "-q", "-f", "qcow2", "-o", OPTS, "-b", root.name, "-F", "qcow2", str(leaf))
    io(leaf, "write -P 0x22 2M 64k")               # the guest's own data, over parent zeros
    io(leaf, "discard 512k 7M")                    # a full trim: over parent data and parent zeros
    io(leaf, "write -P 0x33 4M 4k")                # written again after the trim
    before = tmp_path / "before.qcow2"
    shutil.copy(leaf, before)
    own = manifest_of_layer(leaf, None)
    root_manifest = manifest_of_layer(root, None)
    assert own.zero_blocks > 1000                  # the trim marked every cluster it covered

    done = drop_covered_zeros(leaf, ["ab" * 32], lambda _lid: root_manifest)

    after = manifest_of_layer(leaf, None)
    # only the discarded half MiB of parent data stays zero-marked; the data blocks are all still there
    assert after.zero_blocks == (512 * 1024) // BLOCK_SIZE
    assert done.dropped == own.zero_blocks - after.zero_blocks and done.zero_after == after.zero_blocks
    assert after.nonzero_blocks == own.nonzero_blocks
    sh("qemu-img", "compare", "-q", str(before), str(leaf))   # the guest reads the same, block for block
    sh("qemu-img", "check", "-q", str(leaf))
    assert leaf.stat().st_mode & 0o777 == before.stat().st_mode & 0o777
    # nothing to drop: the file is left as it is
    mtime = leaf.stat().st_mtime_ns
    assert drop_covered_zeros(leaf, ["ab" * 32], lambda _lid: root_manifest).dropped == 0
    assert leaf.stat().st_mtime_ns == mtime


def test_the_topmost_layer_decides_what_the_chain_reads():
    def layer(records: list[tuple[int, bool]]) -> Manifest:
        blob = b"".join((i << 1 | z).to_bytes(8, "little") + (b"\0" * 32 if z else bytes([i + 1]) * 32)
                        for i, z in records)
        return Manifest("layer", "blake3", BLOCK_SIZE, 8 * BLOCK_SIZE, None, blob)

    below = chain_nonzero([layer([(0, False), (1, False), (2, False)]), layer([(1, True), (5, False)])], 8)
    assert list(below) == [1, 0, 1, 0, 0, 1, 0, 0]


def test_released_blocks_read_as_the_parent_again(tmp_path):
    root = tmp_path / ("cd" * 32 + ".qcow2")
    sh("qemu-img", "create", "-q", "-f", "qcow2", "-o", OPTS, str(root), "4M")
    io(root, "write -P 0x11 0 2M")                 # the parent's data (its "old journal")
    leaf = tmp_path / "leaf.qcow2"
    sh("qemu-img", "create", "-q", "-f", "qcow2", "-o", OPTS, "-b", root.name, "-F", "qcow2", str(leaf))
    io(leaf, "write -P 0x22 0 1M")                 # the run rewrote the first MiB
    io(leaf, "write -P 0x33 3M 8k")                # and wrote elsewhere, over parent zeros
    io(leaf, "discard 1M 128k")                    # and discarded a cluster of parent data
    root_manifest = manifest_of_layer(root, None)
    # release blocks 1..255 of the rewritten MiB (block 0 stays, like the journal's superblock), the
    # discarded cluster's zero marks and a block the leaf never held
    drop = set(range(1, 256)) | set(range(256, 288)) | {600}

    done = drop_covered_zeros(leaf, ["cd" * 32], lambda _lid: root_manifest, drop)

    assert done.released == 255 + 32, "block 600 was not the leaf's: nothing to release there"
    after = manifest_of_layer(leaf, None)
    assert {i for i, _z, _h in after.records()} == {0, 768, 769}
    sh("qemu-io", "-f", "qcow2", "-c", "read -P 0x22 0 4k", "-c", "read -P 0x11 4k 1020k",
       "-c", "read -P 0x11 1M 1M", "-c", "read -P 0x33 3M 8k", "-c", "read -P 0 2M 1M", str(leaf))
    sh("qemu-img", "check", "-q", str(leaf))
