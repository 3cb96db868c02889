"""A layer's manifest built by the extension (``Qcow2Image.own_records``) equals the reference
(``iter_block_runs``) for qemu-img's own images, with and without extended L2 (the property tests on
layers written by qcow2_writer and mutated ones are in tests/unit/test_native_layer.py)."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from hashcache.blocks import BLOCK_SIZE
from hashcache.manifest import _reference_manifest_of_layer, manifest_of_layer


@pytest.mark.tools
@pytest.mark.parametrize("options", ["cluster_size=131072,extended_l2=on", "cluster_size=65536"])
def test_qemu_images_agree(tmp_path: Path, options: str) -> None:
    """qemu-img's layout (a raw image with zero pages converted; a child with data, zeroed and
    discarded ranges written by qemu-io), with and without subclusters."""
    rng = random.Random(3)
    raw = tmp_path / "base.raw"
    raw.write_bytes(b"".join(bytes(BLOCK_SIZE) if rng.random() < 0.35 else rng.randbytes(BLOCK_SIZE)
                             for _ in range(3000)) + rng.randbytes(1000))
    base, top = tmp_path / "base.qcow2", tmp_path / "top.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", "-o", options, raw, base], check=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", "-o", options, top],
                   check=True)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0xab 4k 12k", "-c", "write -z 1M 64k",
                    "-c", "write -P 0 2M 4k", "-c", "write -P 0x11 3M 8k", "-c", "discard 5M 128k",
                    "-c", "write -P 0x22 11M 4k", top], check=True, capture_output=True)
    for path in (base, top):
        got, ref = manifest_of_layer(path, None), _reference_manifest_of_layer(path, None)
        assert got.record_bytes == ref.record_bytes
        assert len(got) > 0
