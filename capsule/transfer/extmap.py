"""Where a layer's blocks lie in its guest's ext4 file system, and where the same file lies in the parent.

A child layer holds the blocks its guest wrote since the parent was sealed; most belong to files that
also exist in the parent (a package update rewrites a library, the journal, a directory). For such a
block the same file in the parent (same path; the same inode number for a file without one, like the
journal) holds what is most like it: the references HCP sends it as a delta against (``hashcache/delta.py``).

Both versions' disks are read the way ``capsule backup files`` reads one (``capsule/backup/files.py``):
flattened to a private raw copy, its journal replayed, parsed by e2fsprogs' ``debugfs`` as the unprivileged
sandbox user — here one run per question with many commands (``debugfs -f``): ``icheck`` (which inode
owns each block), ``ncheck`` (each inode's path), ``dump_extents`` (each file's logical → physical
blocks). The guest wrote what debugfs reads; its answers only choose references, never bytes: the
sender reads every block it encodes from its own store, and the receiver checks every block it rebuilds
against its hash. A disk that is not ext2/3/4 (or a tool that fails) gives no references, not an error.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from capsule import sandbox
from capsule.backup.files import _Disk, check_path, flattened
from capsule.errors import CapsuleError
from capsule.store import Store

ARGS_PER_COMMAND = 512     # block numbers or inodes in one icheck / ncheck command
_EXTENT = re.compile(r"^\s*(\d+)/\s*(\d+)\s+\d+/\s*\d+\s+(\d+)\s+-\s+(\d+)\s+(\d+)\s+-\s+(\d+)\s+(\d+)\s*(\S*)")
_PAIR = re.compile(r"^(\d+)\t(.+)$")

Extents = list[tuple[int, int, int]]   # (first logical block, first physical block, length), by logical


class Ext4:
    """debugfs questions on one flattened disk (a :func:`capsule.backup.files.flattened` copy)."""

    def __init__(self, disk: _Disk) -> None:
        self.disk = disk
        self._runs = 0

    def run(self, commands: Sequence[str]) -> list[list[str]]:
        """Each command's output lines, in order (one debugfs process for all of them)."""
        if not commands:
            return []
        self._runs += 1
        name = f"commands-{self._runs}"
        path = self.disk.workdir / name
        path.write_text("".join(c + "\n" for c in commands))
        sandbox.hand_over(path)
        proc = sandbox.run(["debugfs", "-c", "-f", name, self.disk.name], self.disk.workdir, timeout=300)
        out: list[list[str]] = [[] for _ in commands]
        at = -1
        for line in str(proc.stdout or "").splitlines():
            if at + 1 < len(commands) and line == f"debugfs: {commands[at + 1]}":
                at += 1
            elif at >= 0:
                out[at].append(line)
        return out

    def owners(self, blocks: Sequence[int]) -> dict[int, int]:
        """block → the inode that owns it (blocks of no file left out)."""
        asked = set(blocks)
        cmds = [f"icheck {' '.join(map(str, blocks[i:i + ARGS_PER_COMMAND]))}"
                for i in range(0, len(blocks), ARGS_PER_COMMAND)]
        found: dict[int, int] = {}
        for lines in self.run(cmds):
            for line in lines:
                m = _PAIR.match(line)
                if m and m.group(2).isdigit() and int(m.group(1)) in asked:
                    found[int(m.group(1))] = int(m.group(2))
        return found

    def paths(self, inodes: Sequence[int]) -> dict[int, str]:
        """inode → one path of it (inodes without one, like the journal's, left out)."""
        asked = set(inodes)
        cmds = [f"ncheck -c {' '.join(map(str, inodes[i:i + ARGS_PER_COMMAND]))}"
                for i in range(0, len(inodes), ARGS_PER_COMMAND)]
        found: dict[int, str] = {}
        for lines in self.run(cmds):
            for line in lines:
                m = _PAIR.match(line)
                if m and int(m.group(1)) in asked and int(m.group(1)) not in found:
                    try:
                        found[int(m.group(1))] = check_path("/" + m.group(2).lstrip("/"))
                    except CapsuleError:
                        continue   # a name debugfs could misread: no reference for it
        return found

    def extents(self, names: Sequence[str]) -> list[Extents]:
        """Each file's extents (``names``: ``"/a/path"`` or ``<inode>``), uninitialised ones left out."""
        out: list[Extents] = []
        for lines in self.run([f"dump_extents {n}" for n in names]):
            ext: Extents = []
            for line in lines:
                m = _EXTENT.match(line)
                if m and m.group(1) == m.group(2) and "uninit" not in m.group(8).lower():
                    ext.append((int(m.group(3)), int(m.group(5)), int(m.group(7))))
            out.append(sorted(ext))
        return out


@dataclass
class Match:
    """A file of the child holding some of the blocks asked about, and the same file in the parent."""

    logical: dict[int, int]   # the child's block → its offset in the file (in blocks)
    parent: Extents           # the parent's file: its extents

    def parent_blocks(self, lo: int, hi: int) -> list[int]:
        """The parent file's blocks at offsets ``lo`` to ``hi`` (excluded) that it has, by offset."""
        out: list[int] = []
        for lstart, pstart, length in self.parent:
            a, b = max(lo, lstart), min(hi, lstart + length)
            out.extend(range(pstart + a - lstart, pstart + b - lstart))
        return out


def matches(child: Ext4, parent: Ext4, blocks: Sequence[int]) -> list[Match]:
    """The files that ``blocks`` (the child's) belong to and that the parent has too (the same path; the
    same inode number for a file without one), with where each block lies in its file."""
    owners = child.owners(blocks)
    inodes = sorted(set(owners.values()))
    if not inodes:
        return []
    paths = child.paths(inodes)
    child_ext = dict(zip(inodes, child.extents([f"<{i}>" for i in inodes]), strict=True))
    parent_names = [f'"{paths[i]}"' if i in paths else f"<{i}>" for i in inodes]
    parent_ext = dict(zip(inodes, parent.extents(parent_names), strict=True))
    found: dict[int, Match] = {}
    for block, inode in sorted(owners.items()):
        if not parent_ext[inode]:
            continue
        logical = next((lstart + block - pstart for lstart, pstart, length in child_ext[inode]
                        if pstart <= block < pstart + length), None)
        if logical is not None:
            found.setdefault(inode, Match({}, parent_ext[inode])).logical[block] = logical
    return list(found.values())


@contextmanager
def layer_views(store: Store, layer_id: str, parent_id: str) -> Iterator[tuple[Ext4, Ext4] | None]:
    """debugfs on the disks the child layer and its parent show (flattened once, for all questions);
    None when they are not ext2/3/4 or cannot be read here (the sandbox user missing, not root)."""
    with ExitStack() as stack:
        try:
            disks = [stack.enter_context(flattened(store.layer_path(lid), store.tmp_dir, lid[:12]))
                     for lid in (layer_id, parent_id)]
            views = (Ext4(disks[0]), Ext4(disks[1]))
            for view in views:   # ext4 blocks are HCP blocks: 4 KiB, numbered from the disk's start
                if not any(re.match(r"Block size:\s+4096$", ln) for ln in view.run(["stats -h"])[0]):
                    raise CapsuleError("no ext2/3/4 file system of 4 KiB blocks")
        except (CapsuleError, OSError, subprocess.SubprocessError):
            views = None
        yield views

