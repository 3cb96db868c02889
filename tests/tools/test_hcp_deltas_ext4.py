"""HCP deltas from the same file in the parent (capsule/transfer/extmap.py): between two real agents, a version
whose guest rewrote a library as a package manager does — a new file written beside the old one, renamed
over it, so its blocks land elsewhere on the disk — sends the library's blocks as one delta against the old
file's blocks, found in both versions' ext4 file systems with debugfs (as the
sandbox user, as `capsule backup files` reads a version), and the version arrives whole and verified.
The encoding, its bounds and the receiver's refusals: tests/unit/test_hcp_deltas.py."""

from __future__ import annotations

import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from capsule import capsules, qemuimg, transfer
from capsule.store import Store
from capsule.store.catalogue import VersionRow
from capsule.store.objectio import has_object
from capsule.transfer import extmap
from hashcache.blocks import BLOCK_SIZE
from testkit.images import make_store
from tests.conftest import Agent

LIB = 96 * BLOCK_SIZE


def _library(rng: random.Random) -> bytes:
    """Something like a shared library: pieces that repeat with small differences, and random ones."""
    words = [rng.randbytes(16) for _ in range(64)]
    return b"".join(rng.choice(words) if rng.random() < 0.7 else rng.randbytes(16) for _ in range(LIB // 16))


def _patched(lib: bytes, rng: random.Random) -> bytes:
    """A rebuilt library: a few bytes changed in every block (addresses, a version string)."""
    buf = bytearray(lib)
    for b in range(0, len(buf), BLOCK_SIZE):
        for _ in range(3):
            at = b + rng.randrange(BLOCK_SIZE - 4)
            buf[at:at + 4] = rng.randbytes(4)
    return bytes(buf)


def _disks(tmp_path: Path) -> tuple[Path, Path, int]:
    """Two ext4 disks: the first made by mkfs.ext4 -d; the second the first after an update rewrote
    /usr/lib/libdemo.so (written to a new inode, renamed over the old one). Returns them and the library's
    block count."""
    rng = random.Random(11)
    root = tmp_path / "root"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "etc").mkdir()
    lib = _library(rng)
    (root / "usr" / "lib" / "libdemo.so").write_bytes(lib)
    (root / "etc" / "hostname").write_text("demo\n")
    for k in range(8):
        (root / "usr" / "lib" / f"other{k}.bin").write_bytes(rng.randbytes(20000))
    one = tmp_path / "one.raw"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", str(root), str(one), "16M"], check=True)
    two = tmp_path / "two.raw"
    shutil.copyfile(one, two)
    new = tmp_path / "libdemo.so.new"
    new.write_bytes(_patched(lib, rng))
    cmds = tmp_path / "update.cmds"
    cmds.write_text(f"write {new} /usr/lib/libdemo.so.dpkg-new\nunlink /usr/lib/libdemo.so\n"
                    "ln /usr/lib/libdemo.so.dpkg-new /usr/lib/libdemo.so\nunlink /usr/lib/libdemo.so.dpkg-new\n")
    subprocess.run(["debugfs", "-w", "-f", str(cmds), str(two)], check=True, capture_output=True)
    return one, two, len(lib) // BLOCK_SIZE


def _version(store: Store, name: str, disk: Path, previous: Path | None) -> VersionRow:
    """``name``'s next version: a layer over its latest holding ``disk``'s blocks (only those that differ
    from ``previous``, as a guest's writes would)."""
    cat = store.catalogue
    base = cat.latest_version(name)
    assert base is not None
    parent = base.chains[0][-1]
    leaf = store.new_leaf_path()
    qemuimg.create_leaf(leaf, store.layer_path(parent))
    new = disk.read_bytes()
    old = previous.read_bytes() if previous is not None else None
    writes = [o for o in range(0, len(new), BLOCK_SIZE)
              if old is None or new[o:o + BLOCK_SIZE] != old[o:o + BLOCK_SIZE]]
    piece = store.temp_path(".block")
    cmds = []
    for o in writes:   # one qemu-io for all of them, each block from its own file
        path = piece.with_name(f"{piece.name}.{o}")
        path.write_bytes(new[o:o + BLOCK_SIZE])
        cmds += ["-c", f"write -s {path} {o} {BLOCK_SIZE}"]
    for k in range(0, len(cmds), 400):
        subprocess.run(["qemu-io", "-f", "qcow2", *cmds[k:k + 400], str(leaf)], check=True, capture_output=True)
    for o in writes:
        piece.with_name(f"{piece.name}.{o}").unlink()
    row = store.seal_layer(leaf, parent)
    version = VersionRow(capsule=name, number=base.number + 1, parent_capsule=name, parent_version=base.number,
                         memory=None, chains=[[*base.chains[0], row.id]], config=base.config, note="",
                         created=time.time())
    with cat.transaction():
        cat.add_layer(row)
        cat.add_version(version)
    return version


@pytest.mark.tools
@pytest.mark.timeout(600)
def test_a_rewritten_library_travels_as_deltas_against_the_old_file(tmp_path, tiny_images):
    one, two, lib_blocks = _disks(tmp_path)
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    capsules.create(a, "cap", "tiny", memory="256M")
    v2 = _version(a, "cap", one, None)
    v3 = _version(a, "cap", two, one)
    top = v3.chains[0][-1]
    with extmap.layer_views(a, top, v2.chains[0][-1]) as views:   # the map on its own, first
        assert views is not None, "the two versions' ext4 file systems could not be read"
        child, parent = views
        novel = [i for i, z, _h in a.layer_manifest(top).records() if not z]
        found = extmap.matches(child, parent, novel)
    lib = max(found, key=lambda m: len(m.logical))   # the library: every one of its blocks is novel
    assert sorted(lib.logical.values()) == list(range(lib_blocks)), lib.logical
    old_blocks = lib.parent_blocks(0, lib_blocks)
    assert len(old_blocks) == lib_blocks and not set(old_blocks) & set(lib.logical), "the new library moved"
    reports = {}
    for label, deltas in (("deltas", True), ("whole", False)):
        b = make_store(tmp_path / label, tiny_images, "tiny")
        agent = Agent(b.home, tmp_path / f"{label}.token")
        try:
            transfer.push(a, v2.ref, agent.url, agent.token)
            r = transfer.push(a, v3.ref, agent.url, agent.token, transfer.Options(xz=True, deltas=deltas))
            reports[label] = next(o for o in r.objects if o.id == top)
            assert has_object(b, "layer", top) and b.layer_manifest(top).digest == top
            assert b.catalogue.version("cap", v3.number) is not None
        finally:
            agent.stop()
    d, w = reports["deltas"], reports["whole"]
    print(f"the update's layer: {d.wire_bytes} wire bytes with deltas ({d.delta_blocks} blocks, {d.delta_bytes} "
          f"bytes of deltas), {w.wire_bytes} without; {lib_blocks} blocks of the library rewritten")
    assert d.delta_blocks >= lib_blocks and w.delta_blocks == 0, (d, w)
    assert d.wire_bytes < 0.5 * w.wire_bytes, (d.wire_bytes, w.wire_bytes)
