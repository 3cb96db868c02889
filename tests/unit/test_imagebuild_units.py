"""Fast checks of the image-build helpers (no VM, no downloads)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest

from capsule.imagebuild.common import (
    AGENT_SOURCE_DIR,
    ImageBuildError,
    agent_binary,
    agent_sources,
    cache_dir,
)
from capsule.imagebuild.cpio import CpioWriter
from capsule.imagebuild.kernel import ModuleTree, modinfo, norm_module
from capsule.imagebuild.tiny import BLOCK_SIZE, PATTERN_BLOCKS, expected_md5, pattern_block, write_tiny_disk

pytestmark = pytest.mark.unit


def test_pattern_blocks_are_distinct_and_sized() -> None:
    assert len(pattern_block(0)) == BLOCK_SIZE
    assert pattern_block(0).startswith(b"CAPSULE-TINY-DISK block #000000\n")
    assert len({pattern_block(i) for i in range(PATTERN_BLOCKS)}) == PATTERN_BLOCKS
    assert expected_md5(0, 1) != expected_md5(1, 1)


def test_tiny_disk_is_sparse(tmp_path: Path) -> None:
    disk = tmp_path / "d.raw"
    write_tiny_disk(disk)
    assert disk.stat().st_size == 64 * 2**20
    assert disk.stat().st_blocks * 512 <= 8 * 2**20
    assert hashlib.md5(disk.read_bytes()[: 3 * BLOCK_SIZE]).hexdigest() == expected_md5(0, 3)


def test_cpio_rejects_escaping_paths() -> None:
    with pytest.raises(ValueError):
        CpioWriter().add_file("../etc/passwd", b"")


def test_norm_module() -> None:
    assert norm_module("virtio-rng.ko") == "virtio_rng"
    assert norm_module("virtio_blk.ko.xz") == "virtio_blk"
    assert norm_module("ext4.ko.zst") == "ext4"


def _fake_module(modinfo_items: list[bytes]) -> bytes:
    """A minimal ELF64 file with a .modinfo section (what the module loader/depmod read)."""
    shstrtab = b"\0.modinfo\0.shstrtab\0"
    body = b"\0".join(modinfo_items) + b"\0"
    ehdr_size, shentsize = 64, 64
    modinfo_off = ehdr_size
    shstr_off = modinfo_off + len(body)
    shoff = shstr_off + len(shstrtab)
    shoff += -shoff % 8
    ehdr = b"\x7fELF\x02\x01\x01" + bytes(9)
    ehdr += struct.pack("<HHIQQQIHHHHHH", 1, 62, 1, 0, 0, shoff, 0, 64, 0, 0, shentsize, 3, 2)
    sections = bytes(shentsize)  # SHN_UNDEF
    sections += struct.pack("<IIQQQQIIQQ", 1, 1, 2, 0, modinfo_off, len(body), 0, 0, 1, 0)
    sections += struct.pack("<IIQQQQIIQQ", 10, 3, 0, 0, shstr_off, len(shstrtab), 0, 0, 1, 0)
    data = ehdr + body + shstrtab
    return data + bytes(shoff - len(data)) + sections


def test_modinfo_parses_elf_section() -> None:
    elf = _fake_module([b"license=GPL", b"depends=virtio,virtio_ring", b"name=virtio_blk", b"alias=a", b"alias=b"])
    info = modinfo(elf)
    assert info["name"] == ["virtio_blk"]
    assert info["depends"] == ["virtio,virtio_ring"]
    assert info["alias"] == ["a", "b"]
    with pytest.raises(ValueError):
        modinfo(b"not an elf")


def test_module_load_order(tmp_path: Path) -> None:
    moddir = tmp_path / "lib/modules/6.1.0-test"
    drivers = moddir / "kernel/drivers"
    drivers.mkdir(parents=True)
    mods = {
        "virtio_ring": b"",
        "virtio": b"virtio_ring",
        "virtio_blk": b"virtio,virtio_ring",
        "virtio-rng": b"virtio,virtio_ring",
    }
    for name, deps in mods.items():
        (drivers / f"{name}.ko").write_bytes(_fake_module([b"depends=" + deps, f"name={name}".encode()]))
    (moddir / "modules.builtin").write_text("kernel/fs/ext4/ext4.ko\n")
    tree = ModuleTree(moddir)
    order, builtin = tree.load_order(["virtio_blk", "virtio_rng", "ext4"])
    assert order == ["virtio_ring", "virtio", "virtio_blk", "virtio_rng"]
    assert builtin == ["ext4"]
    assert tree.relpath("virtio_rng") == "kernel/drivers/virtio-rng.ko"
    with pytest.raises(ImageBuildError, match="virtio_net"):
        tree.load_order(["virtio_net"])


def test_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CAPSULE_IMAGE_CACHE", raising=False)
    work = tmp_path / "builds" / "w1"
    work.mkdir(parents=True)
    assert cache_dir(work) == tmp_path / "builds" / "cache"
    monkeypatch.setenv("CAPSULE_IMAGE_CACHE", str(tmp_path / "c"))
    assert cache_dir(work) == tmp_path / "c" and (tmp_path / "c").is_dir()


def test_agent_source_dir_is_the_repos() -> None:
    names = {p.name for p in agent_sources(AGENT_SOURCE_DIR)}
    assert {"main.c", "protocol.c", "exec.c", "agent.h"} <= names and (AGENT_SOURCE_DIR / "Makefile").is_file()


@pytest.mark.timeout(10)
def test_agent_sources_are_every_c_and_h_file_but_not_the_fuzz_harness(tmp_path: Path) -> None:
    for name in ("main.c", "exec.c", "agent.h", "Makefile", "PROTOCOL.md", "capsule-agent", "fuzz/fuzz_request.c"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x\n")
    assert agent_sources(tmp_path) == [tmp_path / "agent.h", tmp_path / "exec.c", tmp_path / "main.c"]
    assert agent_sources(tmp_path / "no-such-dir") == []


@pytest.mark.timeout(10)
def test_agent_binary_missing_source(tmp_path: Path) -> None:
    (tmp_path / "agent.h").write_text("/* a header alone is no agent */\n")
    with pytest.raises(ImageBuildError, match=r"guest agent sources \(\*\.c in .*\) are missing"):
        agent_binary(source_dir=tmp_path)


def test_agent_binary_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    not_elf = tmp_path / "capsule-agent"
    not_elf.write_text("#!/bin/sh\n")
    monkeypatch.setenv("CAPSULE_AGENT_BINARY", str(not_elf))
    with pytest.raises(ImageBuildError, match="not a static"):
        agent_binary()
    monkeypatch.setenv("CAPSULE_AGENT_BINARY", str(tmp_path / "nope"))
    with pytest.raises(ImageBuildError, match="no such file"):
        agent_binary()
