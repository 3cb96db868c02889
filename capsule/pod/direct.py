"""A pod image straight between CRIU's directory in the guest and a disk this host lends it: no archive
file in the guest, no ``dd``. A checkpoint lends a sparse file as big as the image may be
(:func:`capsule.pod.replies.image_cap`; only what the guest writes takes room) before the dump, so the
pod stops only for the dump and the write; ``pods checkpoint POD --to DEVICE`` packs the archive onto it
and answers its size and MD5; the host checks the MD5 of what arrived and seals it. The guest keeps the
dump until then: removed once the image is sealed, the pod restarted from it (``pods restore-dump``)
should anything fail. A restore lends the sealed image read-only; ``pods restore DEVICE --size N --md5 H``
checks and unpacks it from there.

A pod layer that predates this (its command line refuses ``--to``) raises
:class:`~capsule.pod.errors.PodLayerOutdated` before anything is dumped, as a guest that takes no lent
disk raises :class:`~capsule.runtime.hotdisk.HotDiskUnavailable`: the caller takes the path through a
file in the guest (:mod:`capsule.pod.relay`'s download and upload)."""

from __future__ import annotations

import secrets
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsule.pod import POD_IMAGE_ROLE, keep_sealed, replies
from capsule.pod.errors import PodFailed
from capsule.pod.relay import DISK_CHECK, Progress, Relay, _file_digest
from capsule.runtime.hotdisk import scratch_file
from capsule.store import Store
from capsule.store.catalogue import FileRow

DUMPS = "/var/lib/pods/dump"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"   # a format-1 image (.tar.zst): unpacked from a file only


@dataclass(frozen=True)
class Checkpointed:
    row: FileRow
    placed: replies.Placed
    copy_seconds: float      # the disk's lending and return, and the host's check of what came


def checkpoint(store: Store, relay: Relay, capsule: str, pod: str, leave_running: bool, cap: int,
               progress: Progress) -> Checkpointed:
    """``pods checkpoint POD --to DEVICE`` onto a disk lent for it; the image sealed in ``store``."""
    scratch = scratch_file(relay.sock.parent / f"lent-{secrets.token_hex(8)}.raw", cap)  # where QEMU may reach
    tmp = store.temp_path(".pod")
    try:
        t0 = time.monotonic()
        with relay.lent(scratch, writable=True) as device:
            lend_seconds = time.monotonic() - t0
            if progress:
                progress("dumping onto a lent disk")
            result = relay.call("checkpoint", pod, *(["--leave-running"] if leave_running else []),
                                "--to", device, timeout=180)
            t1 = time.monotonic()
        dump = replies.dump_id(result, capsule, pod)   # an id it did not ask about: nothing of it is touched
        done = False
        try:
            placed = replies.placed(result, capsule, pod, cap)
            with scratch.open("r+b") as f:
                f.truncate(placed.size)
            if _file_digest(scratch, DISK_CHECK) != placed.md5:
                raise PodFailed(f"capsule {capsule!r}: pod {pod!r}'s image came out damaged on the lent disk")
            scratch.replace(tmp)
            copy_seconds = lend_seconds + time.monotonic() - t1
            row = keep_sealed(store, tmp, POD_IMAGE_ROLE)
            done = True
        finally:
            if not done and not leave_running:
                relay.call("restore-dump", dump, timeout=180)   # the pod runs on where it was
            else:
                relay.sh(f"rm -rf {shlex.quote(f'{DUMPS}/{dump}')}")
    finally:
        scratch.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return Checkpointed(row, placed, round(copy_seconds, 3))


def can_restore(image: Path) -> bool:
    """Whether a sealed image can be unpacked from a lent disk: format 2 (a format-1 ``.tar.zst`` cannot)."""
    with image.open("rb") as f:
        return f.read(4) != ZSTD_MAGIC


def restore(relay: Relay, image: Path, progress: Progress) -> tuple[Any, float]:
    """``pods restore DEVICE --size N --md5 H`` from the sealed ``image`` lent read-only; the guest's result
    and the seconds spent on the host's side of the copy (its MD5, the lending)."""
    t0 = time.monotonic()
    size = image.stat().st_size
    md5 = _file_digest(image, DISK_CHECK)
    with relay.lent(image, writable=False) as device:
        copy_seconds = time.monotonic() - t0
        if progress:
            progress("restoring from a lent disk")
        result = relay.call("restore", device, "--size", str(size), "--md5", md5, timeout=180)
    return result, round(copy_seconds, 3)
