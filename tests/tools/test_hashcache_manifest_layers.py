"""Layer manifests of qcow2 chains made with qemu-img and qemu-io."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from blake3 import blake3

from hashcache.blocks import NULL_HASH
from hashcache.errors import ManifestMismatch
from hashcache.manifest import (
    manifest_of_layer,
    verify_file,
    verify_layer,
)
from hashcache.qcow2 import DATA, Qcow2Image
from tests.unit.test_hashcache_manifest import B, needs_qemu, pattern

pytestmark = pytest.mark.tools


def run(*args: str | Path) -> None:
    subprocess.run([str(a) for a in args], check=True, capture_output=True)


@pytest.fixture
def chain(tmp_path: Path) -> dict[str, Path]:
    raw = tmp_path / "base.raw"
    raw.write_bytes(b"".join(pattern(i) if i % 5 else bytes(B) for i in range(1024)))
    base = tmp_path / "base.qcow2"
    run(
        "qemu-img",
        "convert",
        "-f",
        "raw",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=131072,extended_l2=on",
        raw,
        base,
    )
    top = tmp_path / "top.qcow2"
    run(
        "qemu-img",
        "create",
        "-f",
        "qcow2",
        "-b",
        base,
        "-F",
        "qcow2",
        "-o",
        "cluster_size=131072,extended_l2=on",
        top,
    )
    run(
        "qemu-io", "-f", "qcow2", "-c", "write -P 0xab 4k 4k", "-c", "write -z 1M 64k",
        "-c", "write -P 0 2M 4k", "-c", "write -P 0x11 3M 8k", top,
    )  # fmt: skip
    return {"raw": raw, "base": base, "top": top}


@needs_qemu
def test_layer_manifests(chain: dict[str, Path], tmp_path: Path) -> None:
    base = manifest_of_layer(chain["base"], None)
    assert base.kind == "layer" and base.parent is None and base.size == 1024 * B
    raw = chain["raw"].read_bytes()
    # qemu-img convert leaves whole zero subclusters unallocated; what is listed matches the raw data.
    for i, is_zero, h in base.records():
        block = raw[i * B : (i + 1) * B]
        assert is_zero == (block == bytes(B))
        assert h == (NULL_HASH if is_zero else blake3(block).digest())
    assert all(base.hash_of(i) is not None for i in range(1024) if i % 5)

    top = manifest_of_layer(chain["top"], base.digest)
    assert top.parent == base.digest
    listed = {i: z for i, z, _ in top.records()}
    expected = {1: False, 512: True, 768: False, 769: False} | {i: True for i in range(256, 272)}
    assert listed == expected  # write -P 0 stores zero data: flagged zero, not stored
    assert top.hash_of(1) == blake3(b"\xab" * B).digest()
    assert top.nonzero_blocks == 3 and top.zero_blocks == 17 and top.stored_bytes == 3 * B

    # Stable, and the parent is part of the identity.
    assert manifest_of_layer(chain["top"], base.digest).digest == top.digest
    assert manifest_of_layer(chain["top"], None).digest != top.digest
    verify_layer(chain["top"], top, "top")
    verify_layer(chain["base"], base, "base")


@needs_qemu
def test_layer_progress(chain: dict[str, Path]) -> None:
    calls: list[tuple[int, int]] = []
    manifest_of_layer(chain["base"], None, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (1024 * B, 1024 * B)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


@needs_qemu
def test_verify_layer_detects_tampered_byte(chain: dict[str, Path]) -> None:
    top = manifest_of_layer(chain["top"], "cd" * 32)
    with Qcow2Image(chain["top"]) as img:
        found = img.block_kind(769)
    assert found is not None and found[0] is DATA and found[1] is not None
    with open(chain["top"], "r+b") as f:
        f.seek(found[1] + 1234)
        f.write(b"\x12")
    with pytest.raises(ManifestMismatch) as info:
        verify_layer(chain["top"], top, "top")
    assert info.value.block == 769 and info.value.object_name == "top"
    assert str(info.value) == "layer top: block 769 does not match its manifest hash"


@needs_qemu
def test_verify_layer_detects_allocation_change(chain: dict[str, Path]) -> None:
    top = manifest_of_layer(chain["top"], None)
    # Same data as the parent, but now allocated in this layer: the layer no longer matches.
    run("qemu-io", "-f", "qcow2", "-c", f"write -P 0x22 {600 * B} 4k", chain["top"])
    with pytest.raises(ManifestMismatch, match="block 600 is allocated in the layer but not listed") as info:
        verify_layer(chain["top"], top, "top")
    assert info.value.block == 600
    with pytest.raises(ManifestMismatch, match="not a file"):
        verify_file(chain["top"], top, "top")

