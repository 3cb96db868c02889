"""A shadow on a file system that fills up mid-write: a short write is not taken for a whole one, and no
block is marked present that was not written."""

from __future__ import annotations

import errno
import os

import pytest

from hashcache import shadow as shadow_mod
from hashcache.blocks import BLOCK_SIZE
from hashcache.shadow import Shadow

pytestmark = [pytest.mark.unit]
BLOCKS = [(i, bytes([i + 1]) * BLOCK_SIZE) for i in range(4)]


def test_the_reference_write_takes_a_short_write_then_enospc_for_a_failure(tmp_path, monkeypatch):
    real = os.pwrite
    calls = []

    def filling(fd, data, offset):  # the kernel's behaviour on a disk filling up: part, then ENOSPC
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data)[:BLOCK_SIZE + 100], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    with Shadow(tmp_path / "s", 8) as sh:
        monkeypatch.setattr(shadow_mod.os, "pwrite", filling)
        with pytest.raises(OSError) as exc:
            sh._reference_write(BLOCKS, True)
        assert exc.value.errno == errno.ENOSPC and len(calls) == 2  # the short write was followed up


def test_a_store_that_fails_with_enospc_marks_no_block_present_and_succeeds_later(tmp_path, monkeypatch):
    real = shadow_mod.native.pwrite_runs

    def full(fd, indices, data, durable):  # the extension writes part, then the disk is full
        os.pwrite(fd, data[:BLOCK_SIZE + 100], indices[0] * BLOCK_SIZE)
        raise OSError(errno.ENOSPC, "No space left on device")

    with Shadow(tmp_path / "s", 8) as sh:
        monkeypatch.setattr(shadow_mod.native, "pwrite_runs", full)
        with pytest.raises(OSError) as exc:
            sh.store(BLOCKS)
        assert exc.value.errno == errno.ENOSPC
        assert sh.missing(range(4)) == [0, 1, 2, 3]
        monkeypatch.setattr(shadow_mod.native, "pwrite_runs", real)
        sh.store(BLOCKS)   # room again: the same call completes
        assert sh.missing(range(4)) == [] and [sh.read(i) for i in range(4)] == [d for _i, d in BLOCKS]


def test_the_extension_reports_a_full_disk_as_enospc(tmp_path):
    """The extension's I/O errors carry their errno (a full disk must become StorageFull, not a crash)."""
    with Shadow(tmp_path / "s", 8) as sh:
        bad_fd = os.open(os.devnull, os.O_RDONLY)
        try:
            with pytest.raises(OSError) as exc:
                shadow_mod.native.pwrite_runs(bad_fd, [0], BLOCKS[0][1], False)
            assert exc.value.errno == errno.EBADF
        finally:
            os.close(bad_fd)
        assert sh.missing(range(1)) == [0]
