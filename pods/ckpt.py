"""Checkpoint and restore of a pod with CRIU: the whole tree under the pod's init, with its
namespaces; established TCP connections kept (``--tcp-established``) and the pod's network locked
(nftables) from the dump until the restore. A pod image is one ``.pod`` archive: CRIU's images + pod.json,
uncompressed with every file's data 4 KiB-aligned so it dedups in the host's store (pods/podimage.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from pods import pod, podimage, timerfds
from pods.init import mountpoints
from pods.names import BRIDGE, PodError, check_name, host_veth

WORK = Path("/var/lib/pods")
CRIU_COMMON = ["--tcp-established", "--network-lock", "nftables", "--file-locks", "--manage-cgroups=soft",
               "-v2"]
IMAGE_FORMAT = 2
# A deleted file a pod still holds open or mapped (POSIX shm after shm_unlink, a temporary file unlinked at
# once) is carried in the image up to this size; CRIU's own default is 1 MiB, which refused a 4 MiB shm
# segment. Larger ones are refused with CRIU's words and what to do about them.
GHOST_LIMIT = 64 << 20
DUMP_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,30}-[0-9]{8}T[0-9]{6}-[0-9]{1,10}")
READS_FORMATS = (1, 2)  # format 1: tar | zstd -3, before the images dedup


class Steps:
    """Where a checkpoint's or a restore's time went in the guest: seconds per named step, in order."""

    def __init__(self) -> None:
        self.t = time.monotonic()
        self.took: dict[str, float] = {}

    def lap(self, step: str) -> None:
        now = time.monotonic()
        self.took[step] = round(self.took.get(step, 0.0) + now - self.t, 3)
        self.t = now

    def done(self) -> dict[str, float]:
        return dict(self.took)


RESTORE_ROOT = WORK / "root"
# the mounts CRIU's restore must see in its own namespace; the rest (tracefs, autofs, configfs …) trip it
CRIU_KEEPS = ("/", "/dev", "/dev/pts", "/dev/shm", "/proc", "/sys", "/sys/fs/cgroup", "/run", "/run/lock")


def _restore_wrapper() -> list[str]:
    """CRIU's restore runs in a private mount namespace holding only mounts it understands, with the
    capsule's root bound at RESTORE_ROOT for ``--root`` (it restores the pod's mounts on top of it)."""
    drop = " ".join(shlex.quote(p) for p in mountpoints() if p not in CRIU_KEEPS)
    script = (f"for m in {drop}; do umount -l \"$m\" 2>/dev/null; done; "
              f"mount --bind / {shlex.quote(str(RESTORE_ROOT))} && exec criu \"$@\"")
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "criu"]


CRIU_OK = Path("/run/pods/criu-ok")  # /run is a tmpfs: a success is remembered for this boot only


def criu_ready(timeout: float = 60.0) -> None:
    """``criu check`` once a boot, before the first checkpoint or restore: a kernel CRIU refuses gives one
    clear error up front (kind ``criu_unsupported``, CRIU's reason quoted) and the pod is never touched."""
    if CRIU_OK.exists():
        return
    try:
        r = subprocess.run(["criu", "check"], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise PodError("criu is not installed in this capsule; pods need an image with criu (the debian image)",
                       "criu_unsupported") from None
    except subprocess.TimeoutExpired:
        raise PodError(f"criu check did not finish in {timeout:.0f} s", "guest_timeout") from None
    if r.returncode != 0:
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        why = "; ".join([ln for ln in lines if "Error" in ln][-3:] or lines[-3:]) or f"exit {r.returncode}"
        raise PodError(f"this capsule's kernel cannot checkpoint or restore pods — criu check says: {why}. "
                       "Its pods keep running; to checkpoint or move them, use a capsule whose kernel CRIU "
                       "supports (the debian image's does; `criu check` in the guest tells what is missing)",
                       "criu_unsupported")
    CRIU_OK.parent.mkdir(parents=True, exist_ok=True)
    CRIU_OK.write_text(r.stdout.strip() or "ok")


def check_soon() -> None:
    """``criu check`` in the background (at a pod's create), so the first checkpoint of this boot finds
    its verdict remembered instead of waiting for it (~0.7 s under TCG). A failure remembers nothing:
    :func:`criu_ready` runs the check again and reports it."""
    if CRIU_OK.exists():
        return
    tmp = shlex.quote(f"{CRIU_OK}.{os.getpid()}")
    script = (f"out=$(criu check 2>&1) && mkdir -p {shlex.quote(str(CRIU_OK.parent))} && "
              f"printf '%s' \"${{out:-ok}}\" > {tmp} && mv {tmp} {shlex.quote(str(CRIU_OK))}")
    with contextlib.suppress(OSError):  # no sh, no criu: criu_ready says so at the checkpoint
        subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)


def _criu(args: list[str], log: Path, what: str, timeout: float, restoring: bool = False) -> None:
    if restoring:
        RESTORE_ROOT.mkdir(parents=True, exist_ok=True)
        args = [*args, "--mntns-compat-mode", "--root", str(RESTORE_ROOT)]
    wrapper = _restore_wrapper() if restoring else ["criu"]
    try:
        r = subprocess.run([*wrapper, *args, "-o", str(log)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PodError(f"criu {what} did not finish in {timeout:.0f} s", "guest_timeout") from None
    if r.returncode != 0:
        tail = ""
        if log.exists():
            errs = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln]
            tail = "; ".join(errs[-4:])
        hint = ""
        if "ghost file" in tail and "increase limit" in tail:
            hint = (f" (a deleted file the pod still holds is larger than the {GHOST_LIMIT >> 20} MiB a pod image "
                    "carries: close or truncate it, or keep it under a name, then checkpoint again)")
        raise PodError(f"criu {what} failed (exit {r.returncode}): {tail or r.stderr.strip()}{hint}", "criu_failed")


def checkpoint(name: str, leave_running: bool = False, timeout: float = 120.0, to: str | None = None
               ) -> dict[str, Any]:
    """Dump the pod into one archive (aligned, uncompressed: HCP compresses and dedups it). Without
    ``leave_running`` the pod is left stopped after the dump with its network still locked, its veth is
    deleted, and only then are its processes killed, so no peer sees a reset: its TCP connections wait
    for the restore. (Were the processes killed first, the namespace's teardown would drop the lock's
    nftables hooks before its eth0, and a peer's retransmission in between would draw a RST.) Should
    the archive fail, the pod is restored in place from the dump.

    With ``to`` (the block device of a disk the host lent) the archive goes straight onto it from the
    start, with its MD5 taken on the way: no file of it in this capsule. The dump directory is then kept
    (its id is ``dump`` in the answer) until the host has the image: ``pods drop DUMP`` removes it,
    ``pods restore-dump DUMP`` restarts the pod from it should the host's copy fail."""
    steps = Steps()
    rec = pod.running(name)
    if pod.frozen(name):
        raise PodError(f"pod {name!r} is suspended; resume it before a checkpoint", "conflict")
    if to is not None and not Path(to).is_block_device():
        raise PodError(f"{to} is not a block device; --to names the disk the host lent for the image",
                       "pod_failed")
    criu_ready()
    steps.lap("check")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    images = WORK / "dump" / f"{name}-{stamp}-{os.getpid()}"
    images.mkdir(parents=True)
    t0 = time.monotonic()
    keep = False
    try:
        args = ["dump", "-t", str(rec["init_pid"]), "-D", str(images), *CRIU_COMMON,
                "--ghost-limit", str(GHOST_LIMIT)]
        args.append("--leave-running" if leave_running else "--leave-stopped")
        _criu(args, images / "dump.log", "dump", timeout)
        dumped = time.monotonic() - t0
        steps.lap("dump")
        if not leave_running:
            pod.unplug(name)  # while the stopped pod's namespace still holds the lock
            pod.kill_cgroup(name)
            pod.forget(name)
            steps.lap("stop")
        meta = {"format": IMAGE_FORMAT, "name": name, "ip": rec["ip"], "cmd": rec["cmd"],
                "created": rec["created"], "checkpointed": time.time()}
        if to is not None:
            try:
                size, md5 = podimage.pack_to(to, images, meta)
            except OSError as exc:
                if not leave_running:
                    _restore_from(images, meta, timeout)
                raise PodError(f"could not write the image of pod {name!r} onto {to} ({exc}); it runs on",
                               "pod_failed") from None
            (images / podimage.META).write_text(json.dumps(meta))
            keep = True
            steps.lap("pack")
            placed: dict[str, Any] = {"dump": images.name, "size": size, "md5": md5}
        else:
            out = WORK / "out" / f"{images.name}.pod"
            out.parent.mkdir(parents=True, exist_ok=True)
            part = out.with_name(out.name + ".part")
            try:
                podimage.pack(images, part, meta)
            except OSError:
                part.unlink(missing_ok=True)
                if not leave_running:
                    _restore_from(images, meta, timeout)
                raise PodError(f"could not write the image of pod {name!r} (disk full?); it runs on",
                               "pod_failed") from None
            os.replace(part, out)
            steps.lap("pack")
            placed = {"path": str(out), "size": out.stat().st_size}
    finally:
        if not keep:
            shutil.rmtree(images, ignore_errors=True)
    steps.lap("clean")
    return {"name": name, **placed, "dump_seconds": round(dumped, 3),
            "seconds": round(time.monotonic() - t0, 3), "left_running": leave_running, "ip": rec["ip"],
            "steps": steps.done()}


def _kept(dump: str) -> Path:
    """The dump directory a ``checkpoint --to`` kept, by its id (a name, never a path)."""
    if not DUMP_ID.fullmatch(dump):
        raise PodError(f"{dump!r} is not a dump's id (POD-YYYYMMDDTHHMMSS-PID)", "invalid_name")
    images = WORK / "dump" / dump
    if not (images / podimage.META).is_file():
        raise PodError(f"no kept dump {dump!r} in this capsule", "not_found")
    return images


def drop(dump: str) -> dict[str, Any]:
    """Remove a dump kept by ``checkpoint --to`` (the host has the image)."""
    images = _kept(dump)
    shutil.rmtree(images)
    return {"dump": dump, "dropped": True}


def restore_dump(dump: str, timeout: float = 120.0) -> dict[str, Any]:
    """Restart the pod from a dump kept by ``checkpoint --to`` (the host's copy failed), then remove it."""
    images = _kept(dump)
    try:
        meta = json.loads((images / podimage.META).read_text())
        rec = _restore_from(images, meta, timeout)
    finally:
        shutil.rmtree(images, ignore_errors=True)
    return pod.describe(rec)


def _unpack(archive: Path, into: Path, size: int | None = None, md5: str | None = None) -> dict[str, Any]:
    try:
        if size is not None and md5 is not None:
            meta = podimage.unpack_from(archive, size, md5, into)
        else:
            meta = podimage.unpack(archive, into)
    except podimage.ImageInvalid as e:
        raise PodError(f"{archive.name} is not a usable pod image: {e}", "integrity") from None
    if meta.get("format") not in READS_FORMATS:
        raise PodError(f"pod image format {meta.get('format')!r} is not one of {READS_FORMATS}", "integrity")
    return meta


def restore(archive: str, timeout: float = 120.0, size: int | None = None, md5: str | None = None
            ) -> dict[str, Any]:
    """Restart a pod from its image in this capsule, with its PIDs, address and connections. With ``size``
    and ``md5``, ``archive`` is the block device of a disk the host lent holding the image from its start:
    it is checked and unpacked straight from there, never copied to a file first."""
    steps = Steps()
    src = Path(archive)
    criu_ready()
    steps.lap("check")
    images = WORK / "restore" / f"{src.name}-{os.getpid()}"
    t0 = time.monotonic()
    try:
        meta = _unpack(src, images, size, md5)
        steps.lap("unpack")
        rec = _restore_from(images, meta, timeout, steps)
    finally:
        shutil.rmtree(images, ignore_errors=True)
    steps.lap("clean")
    out = pod.describe(rec)
    out["seconds"] = round(time.monotonic() - t0, 3)
    out["steps"] = steps.done()
    return out


def _restore_from(images: Path, meta: dict[str, Any], timeout: float, steps: Steps | None = None
                  ) -> dict[str, Any]:
    steps = steps or Steps()
    name = check_name(meta["name"])
    pod._refuse_existing(name)
    iface = pod.choose_address(meta["ip"], name)
    pod.ensure_bridge(iface.network)
    pod.make_cgroup(name)
    veth = host_veth(name)
    pidfile = images / "restored.pid"
    pidfile.unlink(missing_ok=True)
    args = ["restore", "-D", str(images), *CRIU_COMMON, "--restore-detached", "--pidfile", str(pidfile),
            "--external", f"veth[eth0]:{veth}@{BRIDGE}"]
    try:
        _criu(args, images / "restore.log", "restore", timeout, restoring=True)
    except PodError:
        pod.forget(name)
        raise
    steps.lap("criu")
    init_pid = int(pidfile.read_text())
    with contextlib.suppress(OSError, ValueError):   # CRIU restores a due periodic timerfd disarmed
        timerfds.rearm(int(p) for p in (pod.cgroup_of(name) / "cgroup.procs").read_text().split())
    pod.sh(["ip", "link", "set", veth, "up"], "bring the pod's veth up")
    pod.unlock_and_announce(init_pid, meta["ip"])
    steps.lap("network")
    rec = {"name": name, "ip": meta["ip"], "veth": veth, "init_pid": init_pid, "cmd": meta["cmd"],
           "created": meta["created"], "restored": time.time()}
    pod.save(rec)
    return rec
