"""File modes of a store, whatever the umask: the policy, a check, and the repair.

- the store directory and every directory in it: 0700 (guest disks and RAM live here), except that the store
  directory, ``layers/``, ``files/`` and ``instances/`` become 0710 with the group of QEMU's user once a guest
  runs from them (QEMU runs unprivileged: ``runtime/guestaccess.py``);
- memory images: 0400 — guest RAM, readable by the store's owner only. That is
  enough for libvirt: it opens a save image itself (libvirtd runs as root) and hands QEMU a descriptor;
- layers, kernels, initrds and every manifest: 0440 (owner and group read; a guest's QEMU reads its layers,
  kernel and initrd through their group);
- private leaves of running instances: 0660 (written by QEMU, through the group);
- store.json and the catalogue: 0600.

Sealed objects carry no write bit: they never change (see ``SealedObjectError``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from capsule.store.store import Store

DIR_MODE = 0o700
GUEST_DIR_MODE = 0o710   # the store, layers/, files/, instances/: QEMU's group passes through
MEMORY_MODE = 0o400
OBJECT_MODE = 0o440
LEAF_MODE = 0o660
PRIVATE_FILE_MODE = 0o600
SUBDIRS = ("layers", "files", "instances", "tmp", "recv", "remote", "shadows")
GUEST_SUBDIRS = ("layers", "files", "instances")


def file_mode(role: str) -> int:
    """The mode of a sealed file object of ``role`` (memory, kernel, initrd)."""
    return MEMORY_MODE if role == "memory" else OBJECT_MODE


@dataclass
class ModeProblem:
    path: Path
    mode: int
    expected: int

    def describe(self) -> str:
        return (f"{self.path} has mode {self.mode:04o}, expected {self.expected:04o} "
                f"(fix: chmod {self.expected:04o} {self.path}, or `capsule verify --fix-modes`)")


def expected_modes(store: Store) -> Iterator[tuple[Path, int]]:
    """(path, mode) for every path of the store whose mode the policy fixes, as far as it exists."""
    yield store.home, GUEST_DIR_MODE
    for sub in SUBDIRS:
        yield store.home / sub, GUEST_DIR_MODE if sub in GUEST_SUBDIRS else DIR_MODE
    for name in ("store.json", "catalogue.sqlite"):
        yield store.home / name, PRIVATE_FILE_MODE
    roles = {row.id: row.role for row in store.catalogue.files()}
    for path in sorted(store.files_dir.iterdir()):
        if is_leftover(path):
            continue
        if path.name.endswith(".manifest"):
            yield path, OBJECT_MODE
        else:
            yield path, file_mode(roles.get(path.name, "memory"))  # unknown: assume the most private
    for path in sorted(store.layers_dir.iterdir()):
        if not is_leftover(path):
            yield path, LEAF_MODE if path.name.startswith("leaf-") else OBJECT_MODE


def is_leftover(path: Path) -> bool:
    """A file an atomic write made beside its target (``.NAME.XXXX.tmp``, hashcache.atomic) and never renamed:
    its writer was killed. No object is ever read under such a name; ``Store.clean_tmp`` removes old ones."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def check_modes(store: Store) -> list[ModeProblem]:
    """Paths whose permissions are wider than the policy (extra group/other bits, a write bit on a
    sealed object), or that their owner cannot read."""
    problems = []
    for path, expected in expected_modes(store):
        try:
            mode = stat.S_IMODE(path.lstat().st_mode)
        except FileNotFoundError:
            continue
        if mode & ~expected or not mode & stat.S_IRUSR:
            problems.append(ModeProblem(path, mode, expected))
    return problems


def fix_modes(store: Store) -> list[ModeProblem]:
    """Set every path ``check_modes`` reports to its policy mode; returns what was changed."""
    problems = check_modes(store)
    for p in problems:
        os.chmod(p.path, p.expected)
    return problems
