"""A backup's files without booting it: ``capsule backup files NAME@V [PATH]``.

The version's disk — its chain of sealed, read-only layers — is flattened by ``qemu-img`` into a sparse
raw file in the store's ``tmp/`` (only allocated blocks are written), its ext3/4 journal replayed into
that copy (``e2fsck -E journal_only``: a disk saved while mounted may hold its last changes only there),
and read there with e2fsprogs' ``debugfs`` in read-only catastrophic mode (it opens the file system
without trusting its bitmaps and never writes). The flattened copy is removed afterwards; nothing in the
store changes. ext2/3/4 only: the file systems Capsule's images have. A memory backup's disk lacks what
the guest held only in memory (dirty pages) when it was saved. Symbolic links are followed inside the
guest's file system."""

from __future__ import annotations

import posixpath
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from capsule import capsules, demand, qemuimg
from capsule.errors import Conflict, EnvironmentProblem, InvalidInput, NotFound
from capsule.store import Store

MAX_LINKS = 16
_LS_LINE = re.compile(r"^/(\d+)/(\d+)/(\d+)/(\d+)/(.*)/(\d*)/$")
_KINDS = {0o040000: "dir", 0o100000: "file", 0o120000: "symlink", 0o020000: "char", 0o060000: "block",
          0o010000: "fifo", 0o140000: "socket"}


@dataclass
class Entry:
    name: str
    kind: str           # file, dir, symlink, char, block, fifo, socket
    mode: int           # permission bits
    uid: int
    gid: int
    size: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Listing:
    ref: str            # NAME@V
    path: str           # the path asked for, after following links
    kind: str           # "dir" (entries) or "file" (size, content read separately)
    size: int
    entries: list[Entry]

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.ref, "path": self.path, "kind": self.kind, "size": self.size,
                "entries": [e.as_dict() for e in self.entries]}


def check_path(path: str) -> str:
    """An absolute path inside the guest, normalised; refused if debugfs could misread it."""
    if not path.startswith("/"):
        raise InvalidInput(f"give an absolute path inside the guest, like /etc/hostname (not {path!r})")
    if any(c == '"' or ord(c) < 32 or ord(c) == 127 for c in path):
        raise InvalidInput("the path holds a quote or a control character; backup files cannot read it")
    if ".." in path.split("/"):
        raise InvalidInput("give the path without `..`: a symbolic link in the guest could make it name "
                           "another file than it seems")
    return posixpath.normpath(path).replace("//", "/")


class _Disk:
    """A flattened disk and debugfs commands on it."""

    def __init__(self, raw: Path, ref: str) -> None:
        self.raw = raw
        self.ref = ref

    def command(self, request: str) -> str:
        try:
            proc = subprocess.run(["debugfs", "-c", "-R", request, str(self.raw)], capture_output=True,
                                  text=True, errors="surrogateescape", timeout=300, check=False)
        except FileNotFoundError as exc:
            raise EnvironmentProblem("debugfs (e2fsprogs) is not installed; run `make setup`") from exc
        problems = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("debugfs ")]
        for line in problems:
            if "while trying to open" in line or "Bad magic number" in line:
                raise InvalidInput(f"{self.ref}'s disk holds no ext2/3/4 file system that backup files can "
                                   f"read ({line.strip()})")
            if "File not found" in line:
                raise NotFound(f"{self.ref} has no {request.split(' ', 2)[-1].strip(chr(34))}")
            if "not a directory" in line:
                raise NotFound(f"{self.ref}: a part of that path is not a directory")
        if proc.returncode != 0:
            raise EnvironmentProblem(f"debugfs failed on {self.ref}'s disk: {' / '.join(problems[-3:])}")
        return proc.stdout

    def stat(self, path: str) -> tuple[str, int, str | None]:
        """(kind, size, link target) of ``path`` itself."""
        out = self.command(f'stat "{path}"')
        m = re.search(r"Type:\s+(\w+)", out)
        size = re.search(r"Size:\s+(\d+)", out)
        if not m:
            raise NotFound(f"{self.ref} has no {path}")
        kind = {"regular": "file", "directory": "dir"}.get(m.group(1), m.group(1))
        target = None
        if kind == "symlink":
            t = re.search(r'Fast link dest: "(.*)"', out)
            target = t.group(1) if t else self.command(f'cat "{path}"')
        return kind, int(size.group(1)) if size else 0, target

    def resolve(self, path: str) -> tuple[str, str, int]:
        """Follow symbolic links (inside the guest's file system) to what ``path`` names."""
        for _ in range(MAX_LINKS):
            kind, size, target = self.stat(path)
            if kind != "symlink":
                return path, kind, size
            assert target is not None
            # a link's own `..` is resolved by name (as the link's directory was reached)
            joined = target if target.startswith("/") else posixpath.join(posixpath.dirname(path), target)
            path = check_path(posixpath.normpath(joined))
        raise InvalidInput(f"{self.ref}: more than {MAX_LINKS} symbolic links in a row from {path}")

    def entries(self, path: str) -> list[Entry]:
        out = []
        for line in self.command(f'ls -p "{path}"').splitlines():
            m = _LS_LINE.match(line)
            if not m or m.group(5) in (".", ".."):
                continue
            mode = int(m.group(2), 8)
            out.append(Entry(m.group(5), _KINDS.get(mode & 0o170000, "other"), mode & 0o7777, int(m.group(3)),
                             int(m.group(4)), int(m.group(6) or 0)))
        return sorted(out, key=lambda e: e.name)

    def dump(self, path: str, out: Path) -> None:
        self.command(f'dump "{path}" "{out}"')
        if not out.exists():
            raise NotFound(f"{self.ref}: {path} could not be read")


def _replay_journal(raw: Path) -> None:
    """Replay the ext3/4 journal into the private copy: a disk saved while mounted (a memory backup, a
    crash-consistent one) may hold its last metadata only there. Not an ext file system: debugfs says so."""
    try:
        subprocess.run(["e2fsck", "-E", "journal_only", "-y", str(raw)], capture_output=True, timeout=600,
                       check=False)
    except FileNotFoundError as exc:
        raise EnvironmentProblem("e2fsck (e2fsprogs) is not installed; run `make setup`") from exc


@contextmanager
def _disk(store: Store, ref: str, disk: int) -> Iterator[_Disk]:
    version = capsules.resolve(store, ref)
    if not 0 <= disk < len(version.chains):
        raise InvalidInput(f"{version.ref} has {len(version.chains)} disk(s): give --disk 0"
                           + (f" to {len(version.chains) - 1}" if len(version.chains) > 1 else ""))
    chain = version.chains[disk]
    if demand.chain_needs_server(store, chain):
        raise Conflict(f"{version.ref}'s disk is still partly on another host (demand-paged): "
                       "`capsule localize` fetches the rest first")
    top = store.layer_path(chain[-1])
    raw = store.temp_path(".raw")
    try:
        qemuimg.flatten_to_raw(top, raw)
        _replay_journal(raw)
        yield _Disk(raw, version.ref)
    finally:
        raw.unlink(missing_ok=True)


def listing(store: Store, ref: str, path: str = "/", *, disk: int = 0, save_to: Path | None = None) -> Listing:
    """What ``path`` is in version ``ref``'s disk: a directory's entries, or a file's size — and, with
    ``save_to``, the file's bytes copied there (written whole, then renamed; a directory writes nothing)."""
    path = check_path(path)
    with _disk(store, ref, disk) as d:
        real, kind, size = d.resolve(path)
        if kind == "dir":
            return Listing(d.ref, real, kind, size, d.entries(real))
        if kind != "file":
            raise InvalidInput(f"{d.ref}: {real} is a {kind}, not a file or directory")
        if save_to is not None:
            part = store.temp_path(".file")
            try:
                d.dump(real, part)
                tmp = save_to.with_name(f".{save_to.name}.part")
                shutil.copyfile(part, tmp)
                tmp.replace(save_to)
            finally:
                part.unlink(missing_ok=True)
        return Listing(d.ref, real, kind, size, [])
