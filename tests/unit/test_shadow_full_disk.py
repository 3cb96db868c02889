"""A shadow on a file system that fills up mid-write: a short write is not taken for a whole one."""

from __future__ import annotations

import errno
import os

import pytest

from hashcache import shadow as shadow_mod
from hashcache.blocks import BLOCK_SIZE
from hashcache.shadow import Shadow

pytestmark = [pytest.mark.unit]


def test_a_short_write_then_enospc_marks_no_block_present_that_was_not_written(tmp_path, monkeypatch):
    real = os.pwrite
    calls = []

    def filling(fd, data, offset):  # the kernel's behaviour on a disk filling up: part, then ENOSPC
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data)[:BLOCK_SIZE + 100], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    blocks = [(i, bytes([i + 1]) * BLOCK_SIZE) for i in range(4)]
    with Shadow(tmp_path / "s", 8) as sh:
        monkeypatch.setattr(shadow_mod.os, "pwrite", filling)
        with pytest.raises(OSError) as exc:
            sh.store(blocks)
        assert exc.value.errno == errno.ENOSPC
        monkeypatch.setattr(shadow_mod.os, "pwrite", real)
        assert sh.missing(range(4)) == [0, 1, 2, 3]
        sh.store(blocks)   # room again: the same call completes
        assert sh.missing(range(4)) == [] and [sh.read(i) for i in range(4)] == [d for _i, d in blocks]
