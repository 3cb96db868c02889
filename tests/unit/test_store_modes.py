"""File modes of a store whatever the umask (guest RAM is not world-readable), their
check in verify and doctor, their repair; store.json written durably."""

from __future__ import annotations

import os
import stat

import pytest

from capsule.doctor import _modes_check
from capsule.store import Store
from capsule.store.modes import DIR_MODE, GUEST_DIR_MODE, MEMORY_MODE, OBJECT_MODE, SUBDIRS, check_modes
from capsule.verify import verify
from tests.helpers.received import receive_file, receive_layer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def open_umask():
    old = os.umask(0)
    yield
    os.umask(old)


@pytest.fixture
def store(tmp_path, open_umask):
    s = Store.open(tmp_path / "store")
    yield s
    s.close()


def test_a_new_store_is_private_whatever_the_umask(store, tmp_path):
    assert _mode(store.home) == DIR_MODE
    for sub in SUBDIRS:
        assert _mode(store.home / sub) == DIR_MODE, sub
    assert _mode(store.home / "store.json") == 0o600
    assert _mode(store.home / "catalogue.sqlite") == 0o600

    src = tmp_path / "ram"
    src.write_bytes(b"guest secrets" * 1000)
    memory = store.seal_file(src, "memory")
    src.write_bytes(b"a kernel" * 1000)
    kernel = store.seal_file(src, "kernel")
    assert _mode(store.file_path(memory.id)) == MEMORY_MODE == 0o400
    assert _mode(store.file_path(kernel.id)) == OBJECT_MODE == 0o440
    assert _mode(store.file_manifest_path(memory.id)) == OBJECT_MODE


def test_received_objects_get_their_modes(store, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    memory = receive_file(store, work, 1, "memory")
    initrd = receive_file(store, work, 2, "initrd")
    layer = receive_layer(store, work, 3)
    assert _mode(store.file_path(memory)) == MEMORY_MODE
    assert _mode(store.file_path(initrd)) == OBJECT_MODE
    assert _mode(store.layer_path(layer)) == OBJECT_MODE
    assert _mode(store.layer_manifest_path(layer)) == OBJECT_MODE
    assert check_modes(store) == []


def test_verify_reports_wrong_modes_and_fixes_them(store, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    memory = receive_file(store, work, 1, "memory")
    kernel = receive_file(store, work, 2, "kernel")
    assert verify(store).ok
    os.chmod(store.file_path(memory), 0o444)      # what sealing used to do: guest RAM for everyone
    os.chmod(store.file_path(kernel), 0o640)      # a sealed object with a write bit
    os.chmod(store.home, 0o755)
    report = verify(store)
    bad = {p.id: p.error for p in report.problems if p.kind == "mode"}
    assert set(bad) == {str(store.file_path(memory)), str(store.file_path(kernel)), str(store.home)}
    assert "expected 0400" in bad[str(store.file_path(memory))] and "chmod 0400" in bad[str(store.file_path(memory))]
    assert not report.ok

    check = _modes_check(store)
    assert not check.ok and "capsule verify --fix-modes" in check.detail and "0444" in check.detail

    fixed = verify(store, repair_modes=True)
    assert fixed.ok and len(fixed.fixed_modes) == 3
    assert _mode(store.file_path(memory)) == MEMORY_MODE and _mode(store.home) == GUEST_DIR_MODE
    assert _modes_check(store).ok


def test_an_existing_store_keeps_its_modes_until_asked(tmp_path, open_umask):
    home = tmp_path / "store"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    Store.open(home).close()
    assert _mode(home) == 0o755                   # not changed behind the owner's back …
    s = Store.open(home)
    try:
        assert [p.path for p in check_modes(s)] == [home]   # … but reported
    finally:
        s.close()


def test_store_json_is_written_durably(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    s = Store.open(tmp_path / "store")
    s.close()
    home = str(tmp_path / "store")
    assert any(os.path.basename(p).startswith(".store.json.") for p in synced)  # the data, before the rename
    assert home in synced                                                        # the rename
    assert not [p for p in os.listdir(home) if p.startswith(".store.json") or p.endswith(".tmp")]


def test_an_atomic_write_killed_midway_is_no_mode_problem_and_gc_removes_it(store):
    """A manifest being written when the agent was SIGKILLed leaves its temporary file (mode 0600, never
    renamed) beside the layers: it is no object, so verify does not report it; clean_tmp removes it once it is
    older than any write under way (the fault bench found 12 of 20 agent kills reported as a mode problem)."""
    leftover = store.layers_dir / f".{'ab' * 32}.manifest.k3x9q1.tmp"
    leftover.write_bytes(b"half a manifest")
    os.chmod(leftover, 0o600)
    in_files = store.files_dir / f".{'cd' * 32}.manifest.zz81aa.tmp"
    in_files.write_bytes(b"")
    assert check_modes(store) == []
    assert verify(store).ok
    assert store.clean_tmp() == 0 and leftover.exists()          # young: perhaps a write under way
    old = leftover.stat().st_mtime - 7200
    os.utime(leftover, (old, old))
    os.utime(in_files, (old, old))
    assert store.clean_tmp() == 2 and not leftover.exists() and not in_files.exists()
