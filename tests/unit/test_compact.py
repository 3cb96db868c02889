"""capsule.compact: zero marks a discard leaves over blocks the parent chain already reads as zero are
dropped; the guest's view of the chain is unchanged (checked by qemu-img compare), and zero marks over the
parent's data stay."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from capsule.compact import chain_nonzero, drop_covered_zeros
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
