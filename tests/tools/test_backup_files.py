"""Reading a backup's files without booting: the reader on a real two-layer qcow2 chain of an ext4 file
system made by mkfs.ext4, and the tools parsing it as the unprivileged sandbox user: no capabilities, no
write outside their copy, damage a clear error (paths checked before debugfs sees them:
tests/unit/test_backup_files.py)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsule import qemuimg, sandbox
from capsule.backup.files import _Disk, flattened
from capsule.errors import CapsuleError, IntegrityError, InvalidInput, NotFound


def _ext4(root: Path, out: Path) -> None:
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", str(root), str(out), "16M"], check=True)


@pytest.fixture
def chain(tmp_path) -> Iterator[_Disk]:
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
    with flattened(child, tmp_path, "x@2") as disk:
        yield disk


def flattened_raw(raw: Path, tmp_path: Path, ref: str):
    """A raw image as `backup files` would read it (a one-layer qcow2 chain)."""
    layer = tmp_path / f"{raw.stem}.qcow2"
    subprocess.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", str(raw), str(layer)], check=True)
    return flattened(layer, tmp_path, ref)


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
    with flattened_raw(junk, tmp_path, "y@1") as disk, pytest.raises(InvalidInput, match="no ext2/3/4"):
        disk.resolve("/")


# --- the guest's file system is parsed as the unprivileged sandbox user -----------------------------------

@pytest.mark.tools
@pytest.mark.timeout(60)
def test_the_sandbox_runs_unprivileged_with_no_capabilities(tmp_path):
    uid, gid = sandbox.ids()
    assert uid != 0 and gid != 0
    with sandbox.workdir(tmp_path) as work:
        proc = sandbox.run(["cat", "/proc/self/status"], work, timeout=30)
    assert proc.returncode == 0, proc.stderr
    status = dict(line.split(":", 1) for line in proc.stdout.splitlines())
    assert status["Uid"].split() == [str(uid)] * 4 and status["Gid"].split() == [str(gid)] * 4
    assert status["Groups"].split() == []
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, caps
    assert status["NoNewPrivs"].strip() == "1"
    assert not work.exists()


@pytest.mark.tools
@pytest.mark.timeout(60)
def test_debugfs_cannot_write_outside_its_copy(chain, tmp_path):
    """A request that would write (as a hostile file system might make a tool do) writes nothing: debugfs runs
    as the sandbox user, which can neither replace a root-owned file nor reach the store's own files."""
    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    for target in (str(victim), "../base.qcow2", "../new-file"):
        with pytest.raises(CapsuleError):
            chain.command(f'dump "/etc/hostname" "{target}"')
    assert victim.read_text() == "root's\n" and not (tmp_path / "new-file").exists()
    assert (tmp_path / "base.qcow2").read_bytes()[:4] == b"QFI\xfb"
    copy = chain.workdir / chain.name
    assert copy.stat().st_uid == sandbox.ids()[0] and chain.workdir.stat().st_uid == 0
    assert oct(chain.workdir.stat().st_mode & 0o777) == oct(0o710)


def _damaged(tmp_path: Path) -> Path:
    """An ext4 made by mkfs.ext4 -d whose root directory block is then overwritten with junk."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("guest\n")
    raw = tmp_path / "damaged.raw"
    _ext4(root, raw)
    bmap = subprocess.run(["debugfs", "-R", "bmap / 0", str(raw)], capture_output=True, text=True, check=True)
    block = int(bmap.stdout.split()[-1])
    with open(raw, "r+b") as f:
        f.seek(block * 4096)
        f.write(os.urandom(4096))
    return raw


@pytest.mark.tools
@pytest.mark.timeout(60)
def test_a_damaged_guest_file_system_is_a_clear_error(tmp_path):
    raw = _damaged(tmp_path)
    with flattened_raw(raw, tmp_path, "z@3") as disk:
        work = disk.workdir
        with pytest.raises(IntegrityError, match=r"z@3's file system is damaged where / lies .*checksum"):
            disk.entries("/")
        with pytest.raises(IntegrityError, match="damaged where /etc/hostname lies"):
            disk.resolve("/etc/hostname")
        out = tmp_path / "out"
        with pytest.raises(IntegrityError):
            disk.dump("/etc/hostname", out)
        assert not out.exists()
    assert not work.exists()


@pytest.mark.tools
@pytest.mark.timeout(60)
def test_the_sandboxed_e2fsck_replays_the_journal(tmp_path):
    """A change that is only in the journal (as on a disk saved while mounted) is read: the unprivileged
    e2fsck could write the journal into its own copy. (A guard: the replay's failure would be silent.)"""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("old-name\n")
    raw = tmp_path / "journal.raw"
    _ext4(root, raw)
    bmap = subprocess.run(["debugfs", "-R", "bmap /etc/hostname 0", str(raw)], capture_output=True, text=True,
                          check=True)
    block = tmp_path / "block"
    block.write_bytes(b"new-name\n".ljust(4096, b"\0"))
    (tmp_path / "cmds").write_text(f"jo\njw -b {int(bmap.stdout.split()[-1])} {block}\njc\n")
    subprocess.run(["debugfs", "-w", "-f", str(tmp_path / "cmds"), str(raw)], capture_output=True, check=True)
    with flattened_raw(raw, tmp_path, "j@1") as disk:
        assert _dump(disk, "/etc/hostname", tmp_path) == b"new-name\n"
