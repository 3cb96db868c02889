"""A backup's files without booting it: ``capsule backup files NAME@V [PATH]``.

The version's disk — its chain of sealed, read-only layers — is flattened by ``qemu-img`` into a sparse
raw file in the store's ``tmp/`` (only allocated blocks are written), its ext3/4 journal replayed into
that copy (``e2fsck -E journal_only``: a disk saved while mounted may hold its last changes only there),
and read there with e2fsprogs' ``debugfs`` in read-only catastrophic mode (it opens the file system
without trusting its bitmaps and never writes). The guest wrote that file system: e2fsck and debugfs parse
it as the unprivileged ``capsule-sandbox`` user with no capabilities (``capsule/sandbox.py``), on a copy
handed to that user alone; a file's bytes come back on debugfs's standard output. Damage in the guest's
file system is an IntegrityError naming the path, never a partial answer. The flattened copy is removed
afterwards; nothing in the store changes. ext2/3/4 only: the file systems Capsule's images have. A memory
backup's disk lacks what the guest held only in memory (dirty pages) when it was saved. Symbolic links are
followed inside the guest's file system."""

from __future__ import annotations

import posixpath
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from capsule import capsules, qemuimg, sandbox
from capsule.errors import Conflict, EnvironmentProblem, IntegrityError, InvalidInput, NotFound
from capsule.lifecycle import demand
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


def _subject(request: str) -> str:
    """The guest path a debugfs request names (between its quotes)."""
    m = re.search(r'"(.*)"', request)
    return m.group(1) if m else request


class _Disk:
    """A flattened disk, handed to the sandbox user, and debugfs commands on it run as that user."""

    def __init__(self, workdir: Path, name: str, ref: str) -> None:
        self.workdir = workdir      # a sandbox.workdir(); the tools start there
        self.name = name            # the flattened copy's name in it, owned by the sandbox user
        self.ref = ref

    def _debugfs(self, request: str, stdout: IO[bytes] | int = subprocess.PIPE) -> subprocess.CompletedProcess:
        return sandbox.run(["debugfs", "-c", "-R", request, self.name], self.workdir, timeout=300, stdout=stdout,
                           text=stdout == subprocess.PIPE)

    def _check(self, request: str, proc: subprocess.CompletedProcess) -> None:
        stderr = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode(errors="replace")
        problems = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("debugfs ")]
        for line in problems:
            if "while trying to open" in line or "Bad magic number" in line:
                raise InvalidInput(f"{self.ref}'s disk holds no ext2/3/4 file system that backup files can "
                                   f"read ({line.strip()})")
            if "File not found" in line:
                raise NotFound(f"{self.ref} has no {_subject(request)}")
            if "not a directory" in line.lower():
                raise NotFound(f"{self.ref}: a part of that path is not a directory")
        if problems:
            # whatever else debugfs reports is damage in the guest's file system (a checksum, an inode):
            # never an empty or partial answer as if it were whole
            raise IntegrityError(f"{self.ref}'s file system is damaged where {_subject(request)} lies "
                                 f"({' / '.join(p.strip() for p in problems[-3:])}); the backup's layers are "
                                 "intact: this is how the guest left its disk")
        if proc.returncode != 0:
            raise EnvironmentProblem(f"debugfs failed on {self.ref}'s disk (exit status {proc.returncode})")

    def command(self, request: str) -> str:
        proc = self._debugfs(request)
        self._check(request, proc)
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
        """The file's bytes into ``out``, a new file the caller's process opens: the sandboxed debugfs only
        writes its standard output."""
        with open(out, "xb") as f:
            proc = self._debugfs(f'cat "{path}"', stdout=f)
        try:
            self._check(f'cat "{path}"', proc)
        except BaseException:
            out.unlink(missing_ok=True)
            raise


def _replay_journal(d: _Disk) -> None:
    """Replay the ext3/4 journal into the private copy: a disk saved while mounted (a memory backup, a
    crash-consistent one) may hold its last metadata only there. Not an ext file system: debugfs says so."""
    sandbox.run(["e2fsck", "-E", "journal_only", "-y", d.name], d.workdir, timeout=600)


@contextmanager
def flattened(top: Path, scratch: Path, ref: str) -> Iterator[_Disk]:
    """The disk layer ``top`` shows, flattened to a private raw copy in a sandbox work directory under
    ``scratch``, its journal replayed — every guest-controlled byte parsed as the sandbox user only."""
    with sandbox.workdir(scratch) as work:
        name = "disk.raw"
        qemuimg.flatten_to_raw(top, work / name)
        sandbox.hand_over(work / name)
        d = _Disk(work, name, ref)
        _replay_journal(d)
        yield d


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
    with flattened(store.layer_path(chain[-1]), store.tmp_dir, version.ref) as d:
        yield d


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
