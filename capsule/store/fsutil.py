"""Small file-system helpers: atomic installs, fsync, ENOSPC translation."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from capsule.errors import StorageFull


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install_readonly(src: Path, dst: Path, mode: int) -> bool:
    """Fsync ``src``, give it ``mode`` (read-only: see modes.py) and rename it to
    ``dst`` (same file system). Returns False (and removes ``src``) when ``dst`` already
    exists: objects are named by their digest, so an existing one is identical."""
    if mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"a sealed object is never writable (mode {mode:04o})")
    if dst.exists():
        src.unlink()
        return False
    fsync_path(src)
    os.chmod(src, mode)
    os.rename(src, dst)
    fsync_dir(dst.parent)
    return True


def make_private_dir(path: Path, mode: int = 0o700) -> None:
    """Create directory ``path`` (its parent must exist) with ``mode`` whatever the umask;
    an existing directory is left as it is (``capsule verify`` reports a wrong mode)."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if not path.is_dir():
            raise
        return
    os.chmod(path, mode)  # mkdir's mode is filtered through the umask


def remove_readonly(path: Path) -> None:
    """Delete a sealed object file (used by gc and rm only)."""
    with suppress(FileNotFoundError):
        path.unlink()


def disk_usage(path: Path) -> int:
    """Allocated bytes of a (possibly sparse) file."""
    return path.stat().st_blocks * 512


@contextmanager
def translating_enospc(what: str) -> Iterator[None]:
    """Turn a full file system into a ``StorageFull`` error naming ``what``."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFull(
                f"{what}: the store's file system is full; nothing was recorded. "
                "Free space (capsule gc, capsule rm) and try again."
            ) from exc
        raise


def is_enospc(exc: BaseException) -> bool:
    text = str(exc).lower()
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "no space left" in text or "enospc" in text or "disk quota" in text

