"""qemu-img operations on layers. Every layer Capsule writes is qcow2 with
128 KiB clusters and extended L2 entries, i.e. 4 KiB subclusters: a guest's
4 KiB write into a child layer allocates 4 KiB, not a whole cluster."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from capsule.errors import EnvironmentProblem, IntegrityError, RuntimeFailure, StorageFull
from capsule.store.fsutil import is_enospc
from capsule.store.modes import LEAF_MODE

LAYER_OPTIONS = "cluster_size=131072,extended_l2=on"


def _run(args: list[str], what: str, corrupt_is_integrity: bool = False) -> str:
    try:
        proc = subprocess.run(["qemu-img", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise EnvironmentProblem("qemu-img is not installed; run `make setup` or `capsule doctor`") from exc
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        tail = " / ".join(err[-3:]) if err else f"exit status {proc.returncode}"
        if is_enospc(RuntimeError(tail)):
            raise StorageFull(f"{what}: the store's file system is full ({tail})")
        cls = IntegrityError if corrupt_is_integrity else RuntimeFailure
        raise cls(f"{what}: {tail}")
    return proc.stdout


def create_leaf(path: Path, backing: Path) -> None:
    """A new empty child layer of ``backing`` (referenced by relative name when
    both live in the same directory)."""
    ref = backing.name if backing.parent == path.parent else str(backing)
    _run(["create", "-q", "-f", "qcow2", "-o", LAYER_OPTIONS, "-b", ref, "-F", "qcow2", str(path)],
         f"creating leaf layer {path.name}")
    os.chmod(path, LEAF_MODE)


def create_empty(path: Path, size: int) -> None:
    """An empty root layer of ``size`` bytes (a new data disk: reads as zeros, no blocks)."""
    _run(["create", "-q", "-f", "qcow2", "-o", LAYER_OPTIONS, str(path), str(size)], f"creating empty disk {path.name}")
    os.chmod(path, LEAF_MODE)


def create_leaf_on(path: Path, backing: str, backing_format: str) -> None:
    """A new empty leaf over any backing QEMU understands (e.g. a ``json:`` NBD export)."""
    _run(["create", "-q", "-f", "qcow2", "-o", LAYER_OPTIONS, "-b", backing, "-F", backing_format, str(path)],
         f"creating leaf layer {path.name}")
    os.chmod(path, LEAF_MODE)


def convert_raw_to_layer(raw: Path, out: Path) -> None:
    """A root layer from a raw disk image (zero areas stay unallocated)."""
    _run(["convert", "-q", "-f", "raw", "-O", "qcow2", "-o", LAYER_OPTIONS, str(raw), str(out)],
         f"converting {raw.name} to a qcow2 layer")
    os.chmod(out, LEAF_MODE)


def flatten_to_raw(top: Path, out: Path) -> None:
    """The whole disk a layer chain shows (``top`` and its backing layers) as one sparse raw file."""
    _run(["convert", "-q", "-U", "-f", "qcow2", "-O", "raw", "-S", "4k", str(top), str(out)],
         f"reading the disk of layer {top.name}", corrupt_is_integrity=True)


def info(path: Path) -> dict[str, Any]:
    out = _run(["info", "-U", "--output=json", str(path)], f"reading {path.name}", corrupt_is_integrity=True)
    return json.loads(out)


def check(path: Path) -> dict[str, Any]:
    """``qemu-img check``; raises IntegrityError if the image is corrupt."""
    # this file only: a layer's parent may live on another host (a demand-paged chain)
    target = "json:" + json.dumps({"driver": "qcow2", "file": {"driver": "file", "filename": str(path.absolute())},
                                   "backing": None})
    proc = subprocess.run(["qemu-img", "check", "-U", "--output=json", target],
                          capture_output=True, text=True, check=False)
    try:
        result = json.loads(proc.stdout) if proc.stdout.strip() else {}
    except ValueError:
        result = {}
    if proc.returncode != 0 or result.get("corruptions", 0) or result.get("check-errors", 0):
        detail = proc.stderr.strip().splitlines()[-1:] or [f"{result.get('corruptions', '?')} corruptions"]
        raise IntegrityError(f"layer file {path.name} is corrupt: {detail[0]}")
    return result


def rebase_safe(path: Path, new_backing: Path | None) -> None:
    """Rebase ``path`` onto ``new_backing`` (or onto nothing), copying into it
    every block that differs, so what the guest sees is unchanged."""
    ref = "" if new_backing is None else (
        new_backing.name if new_backing.parent == path.parent else str(new_backing)
    )
    args = ["rebase", "-q", "-f", "qcow2", "-b", ref]
    if new_backing is not None:
        args += ["-F", "qcow2"]
    _run([*args, str(path)], f"promoting {path.name}")


def rebase_unsafe(path: Path, new_backing: Path) -> None:
    """Only rewrite the backing file name in the header (content unchanged)."""
    ref = new_backing.name if new_backing.parent == path.parent else str(new_backing)
    _run(["rebase", "-q", "-u", "-f", "qcow2", "-b", ref, "-F", "qcow2", str(path)],
         f"re-pointing {path.name} at {new_backing.name}")
