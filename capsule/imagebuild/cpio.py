"""A tiny writer for cpio "newc" archives (the initramfs format), with deterministic output.

Written in Python rather than by calling cpio(1) so that the archive can hold device nodes
(/dev/console) and root ownership without needing them on the host file system.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import PurePosixPath


@dataclass
class _Entry:
    name: str
    mode: int
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


class CpioWriter:
    """Collect entries in memory, then render them as one newc archive (uid/gid 0, mtime 0)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def _parents(self, name: str) -> None:
        parent = PurePosixPath(name).parent
        if str(parent) in (".", "/", ""):
            return
        self._parents(str(parent))
        if str(parent) not in self._entries:
            self._entries[str(parent)] = _Entry(str(parent), stat.S_IFDIR | 0o755)

    @staticmethod
    def _norm(name: str) -> str:
        name = name.strip("/")
        if not name or ".." in PurePosixPath(name).parts:
            raise ValueError(f"bad archive path {name!r}")
        return name

    def add_dir(self, name: str, mode: int = 0o755) -> None:
        name = self._norm(name)
        self._parents(name)
        self._entries[name] = _Entry(name, stat.S_IFDIR | mode)

    def add_file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        name = self._norm(name)
        self._parents(name)
        self._entries[name] = _Entry(name, stat.S_IFREG | mode, data)

    def add_symlink(self, name: str, target: str) -> None:
        name = self._norm(name)
        self._parents(name)
        self._entries[name] = _Entry(name, stat.S_IFLNK | 0o777, target.encode())

    def add_chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        name = self._norm(name)
        self._parents(name)
        self._entries[name] = _Entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def __contains__(self, name: str) -> bool:
        return self._norm(name) in self._entries

    def render(self) -> bytes:
        out = bytearray()
        for ino, entry in enumerate(self._entries.values(), start=1):
            nlink = 2 if stat.S_ISDIR(entry.mode) else 1
            _append(out, entry.name, entry.mode, entry.data, ino, nlink, entry.rdev)
        _append(out, "TRAILER!!!", 0, b"", 0, 1, (0, 0))
        # pad the whole archive to a 512-byte boundary like cpio(1) does
        out += b"\0" * (-len(out) % 512)
        return bytes(out)


def _append(out: bytearray, name: str, mode: int, data: bytes, ino: int, nlink: int, rdev: tuple[int, int]) -> None:
    encoded = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0)
    out += b"070701" + b"".join(b"%08X" % f for f in fields)
    out += encoded
    out += b"\0" * (-len(out) % 4)
    out += data
    out += b"\0" * (-len(out) % 4)
