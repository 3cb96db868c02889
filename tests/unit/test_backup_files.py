"""Reading a backup's files without booting: paths checked before debugfs sees them (unit), and the
reader on a real two-layer qcow2 chain of an ext4 file system made by mkfs.ext4 (tools)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from capsule import qemuimg
from capsule.backup.files import _Disk, check_path
from capsule.errors import InvalidInput, NotFound


@pytest.mark.unit
@pytest.mark.parametrize("path,normal", [("/", "/"), ("/etc/hostname", "/etc/hostname"), ("/a/./b", "/a/b"),
                                         ("//etc//x/", "/etc/x"), ("/sp ace/x", "/sp ace/x")])
def test_paths_are_normalised(path, normal):
    assert check_path(path) == normal


@pytest.mark.unit
@pytest.mark.parametrize("path", ["etc/hostname", "", "~/x", '/a"b', "/a\nb", "/a\x00b", "/a\x7fb", "/a/../b",
                                  "/.."])
def test_paths_debugfs_could_misread_are_refused(path):
    with pytest.raises(InvalidInput):
        check_path(path)


def _ext4(root: Path, out: Path) -> None:
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", str(root), str(out), "16M"], check=True)


@pytest.fixture
def chain(tmp_path) -> _Disk:
    """base.qcow2 (an ext4 with a few files) and child.qcow2 over it holding only what changed, flattened
    the way `backup files` reads a version."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("before\n")
    (root / "kept").mkdir()
    (root / "kept" / "only-in-base.bin").write_bytes(os.urandom(20000))
    (root / "kept" / "sp ace").write_text("a b")
    os.symlink("/etc/hostname", root / "abs-link")
    os.symlink("../etc/hostname", root / "kept" / "rel-link")
    os.symlink("loop-b", root / "loop-a")
    os.symlink("loop-a", root / "loop-b")
    _ext4(root, tmp_path / "base.raw")
    base = tmp_path / "base.qcow2"
    subprocess.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", str(tmp_path / "base.raw"), str(base)],
                   check=True)
    (root / "etc" / "hostname").write_text("after\n")
    (root / "new.txt").write_text("new in the child\n")
    _ext4(root, tmp_path / "child.raw")
    child = tmp_path / "child.qcow2"
    subprocess.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", "-B", "base.qcow2", "-F", "qcow2",
                    str(tmp_path / "child.raw"), str(child)], check=True, cwd=tmp_path)
    assert qemuimg.info(child)["backing-filename"] == "base.qcow2"
    flat = tmp_path / "flat.raw"
    qemuimg.flatten_to_raw(child, flat)
    return _Disk(flat, "x@2")


def _dump(disk: _Disk, path: str, tmp_path: Path) -> bytes:
    out = tmp_path / "out"
    out.unlink(missing_ok=True)
    disk.dump(path, out)
    return out.read_bytes()


@pytest.mark.tools
def test_the_chain_reads_as_the_top_version(chain, tmp_path):
    assert chain.resolve("/etc/hostname") == ("/etc/hostname", "file", 6)
    assert _dump(chain, "/etc/hostname", tmp_path) == b"after\n"
    names = {e.name: e for e in chain.entries("/")}
    assert {"etc", "kept", "new.txt", "abs-link", "lost+found"} <= names.keys()
    assert names["etc"].kind == "dir" and names["abs-link"].kind == "symlink"
    assert names["new.txt"].kind == "file" and names["new.txt"].size == len("new in the child\n")
    kept = {e.name: e for e in chain.entries("/kept")}
    assert kept["only-in-base.bin"].size == 20000 and kept["sp ace"].size == 3
    assert _dump(chain, "/kept/sp ace", tmp_path) == b"a b"
    assert len(_dump(chain, "/kept/only-in-base.bin", tmp_path)) == 20000


@pytest.mark.tools
def test_links_are_followed_inside_the_guest(chain):
    assert chain.resolve("/abs-link")[:2] == ("/etc/hostname", "file")
    assert chain.resolve("/kept/rel-link")[:2] == ("/etc/hostname", "file")
    with pytest.raises(InvalidInput, match="symbolic links"):
        chain.resolve("/loop-a")


@pytest.mark.tools
def test_missing_paths_and_other_disks_are_clear_errors(chain, tmp_path):
    with pytest.raises(NotFound, match="/nope"):
        chain.resolve("/nope")
    with pytest.raises(NotFound):
        chain.resolve("/etc/hostname/below")
    junk = tmp_path / "junk.raw"
    junk.write_bytes(os.urandom(1 << 20))
    with pytest.raises(InvalidInput, match="no ext2/3/4"):
        _Disk(junk, "y@1").resolve("/")
