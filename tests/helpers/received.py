"""Objects installed into a store the way a push's receiver (or a pull) installs them:
blocks into a shadow, then ``install_received`` — without HTTP, guests or qemu-img."""

from __future__ import annotations

import os
from pathlib import Path

from capsule.store import Store
from capsule.store.objectio import install_received, open_shadow
from hashcache.blocks import BLOCK_SIZE
from hashcache.manifest import Manifest, manifest_of_file, manifest_of_layer
from hashcache.qcow2_writer import write_layer


def _fill(store: Store, kind: str, manifest: Manifest, block_of, role: str = "layer") -> None:
    shadow = open_shadow(store, kind, manifest)
    try:
        shadow.store([(i, block_of(i)) for i, zero, _h in manifest.records() if not zero])
        install_received(store, kind, manifest, shadow, role=role)
    finally:
        shadow.close()


def receive_file(store: Store, work: Path, seed: int, role: str = "kernel", blocks: int = 3) -> str:
    """A file object of ``blocks`` distinct blocks; returns its id."""
    src = work / f"file-{seed}"
    src.write_bytes(b"".join(bytes([seed % 251 + 1, k % 251]) * (BLOCK_SIZE // 2) for k in range(blocks)))
    manifest = manifest_of_file(src)
    data = src.read_bytes()
    _fill(store, "file", manifest, lambda i: data[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE].ljust(BLOCK_SIZE, b"\0"),
          role)
    return manifest.digest


def layer_blocks(seed: int) -> dict[int, bytes]:
    """The data blocks of :func:`receive_layer`'s layer of ``seed``, by index."""
    return {0: bytes([seed % 251 + 1]) * BLOCK_SIZE, 5: bytes([seed % 251 + 2]) * BLOCK_SIZE}


def receive_layer(store: Store, work: Path, seed: int, parent: str | None = None) -> str:
    """A small qcow2 layer (two data blocks, one zero block) over ``parent``; returns its id."""
    src = work / f"layer-{seed}.qcow2"
    blocks = layer_blocks(seed)
    write_layer(src, virtual_size=64 * BLOCK_SIZE, backing=f"{parent}.qcow2" if parent else None,
                records=[(0, False), (3, True), (5, False)], read_block=lambda i: blocks[i])
    manifest = manifest_of_layer(src, parent)
    os.unlink(src)
    _fill(store, "layer", manifest, lambda i: blocks[i])
    return manifest.digest


def record_of(name: str, number: int, chain: list[str], kernel: str, initrd: str,
              memory: str | None = None) -> dict:
    return {"capsule": name, "number": number, "uuid": None, "image": None, "parent_capsule": None,
            "parent_version": None, "memory": memory, "chains": [chain], "note": "", "created": 1.0,
            "config": {"memory_mib": 256, "vcpus": 1, "kernel": kernel, "initrd": initrd, "cmdline": "",
                       "marker": "m"}}
