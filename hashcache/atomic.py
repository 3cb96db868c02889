"""Writes that finish whole: a small file atomically (a temp file in the same directory, renamed into place),
and a pwrite of all its bytes."""

from __future__ import annotations

import contextlib
import os
import tempfile


def write_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool = True, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a mix. With
    ``durable`` the data and the rename are fsynced too. The file gets ``mode`` (0644 unless told)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """pwrite all of ``data`` at ``offset``. A file system filling up writes part of it and says how much (only
    the next write raises ENOSPC), so a caller never takes a short write for a whole one."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
