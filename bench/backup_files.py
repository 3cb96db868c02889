"""`capsule backup files` two ways, on a version of the tiny and of the Debian test image: the time to list a
directory (/etc) and to extract a file (/etc/hostname), each a whole call as the CLI makes it. The tiny
image's disk holds no file system (a test pattern): there, the time each takes to refuse it.

* sandbox: what `backup files` does — qemu-img flattens the chain to a private raw copy, e2fsck replays the
  journal and debugfs reads it, both as the unprivileged ``capsule-sandbox`` user with no capabilities;
* libguestfs: ``guestfish --ro`` on the version's top layer (QEMU reads the chain; the appliance's own kernel
  mounts the file system read-only inside a small VM), one appliance boot per call, its appliance built
  beforehand (not timed). ``LIBGUESTFS_BACKEND_SETTINGS=force_tcg`` unless ``--kvm``. libguestfs-tools and a
  kernel for its appliance come from ``scripts/setup-host.sh`` (not for a host image: Capsule does not use it).

    .venv/bin/python bench/backup_files.py [--images tiny,debian] [--reps 3] [--guestfs-reps 2] [--kvm]

Writes bench/results/backup_files.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import image_stores, median, table, temp_workdir, write_result  # noqa: E402


def _timed(fn: Any) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def _guestfish(top: Path, script: list[str], env: dict[str, str]) -> str:
    cmd = ["guestfish", "--ro", "--format=qcow2", "-a", str(top), "run", ":", "mount-ro", "/dev/sda", "/", ":",
           *script]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"guestfish failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def _has_file_system(store: Any, ref: str) -> bool:
    from capsule.backup import files
    from capsule.errors import InvalidInput

    try:
        files.listing(store, ref, "/")
    except InvalidInput:
        return False
    return True


def _refusals(kind: str, store: Any, ref: str, top: Path, reps: int, guestfs_reps: int,
              env: dict[str, str]) -> dict[str, Any]:
    """A disk with no file system (the tiny image's patterned disk): the time each reader takes to say so —
    its fixed cost per call."""
    from capsule.backup import files
    from capsule.errors import InvalidInput

    def refused() -> None:
        try:
            files.listing(store, ref, "/etc")
        except InvalidInput:
            return
        raise RuntimeError("a disk without a file system was read")

    def g_refused() -> None:
        proc = subprocess.run(["guestfish", "--ro", "--format=qcow2", "-a", str(top), "run", ":", "mount-ro",
                               "/dev/sda", "/"], capture_output=True, text=True, env=env, timeout=1800, check=False)
        if proc.returncode == 0:
            raise RuntimeError("libguestfs mounted a disk without a file system")

    g_refused()     # builds (or checks) the appliance once: not timed
    s = [_timed(refused) for _ in range(reps)]
    g = [_timed(g_refused) for _ in range(guestfs_reps)]
    return {"image": kind, "layer_bytes": top.stat().st_size, "file_system": False,
            "sandbox": {"refuse_s": s, "refuse_median_s": median(s)},
            "libguestfs": {"refuse_s": g, "refuse_median_s": median(g)}}


def measure(kind: str, reps: int, guestfs_reps: int, kvm: bool) -> dict[str, Any]:
    from capsule import capsules
    from capsule.backup import files

    with temp_workdir(f"capsule-bench-files-{kind}-") as work:
        store = image_stores(kind, work / "store")[0]
        ref = capsules.create(store, "b", kind).ref
        top = store.layer_path(capsules.resolve(store, ref).chains[0][-1])
        out = work / "hostname"
        hostname = b""
        env = dict(os.environ, LIBGUESTFS_BACKEND="direct")
        if not kvm:
            env["LIBGUESTFS_BACKEND_SETTINGS"] = "force_tcg"
        if not _has_file_system(store, ref):
            return _refusals(kind, store, ref, top, reps, guestfs_reps, env)

        def extract() -> None:
            nonlocal hostname
            files.listing(store, ref, "/etc/hostname", save_to=out)
            hostname = out.read_bytes()

        listed = []
        sandbox_list = [_timed(lambda: listed.append(len(files.listing(store, ref, "/etc").entries)))
                        for _ in range(reps)]
        sandbox_extract = [_timed(extract) for _ in range(reps)]

        _guestfish(top, ["ls", "/"], env)     # builds (or checks) the appliance once: not timed
        g_listed: list[int] = []
        g_host: list[bytes] = []
        guestfs_list = [_timed(lambda: g_listed.append(len(_guestfish(top, ["ls", "/etc"], env).splitlines())))
                        for _ in range(guestfs_reps)]
        g_out = work / "hostname-guestfs"

        def g_extract() -> None:
            _guestfish(top, ["download", "/etc/hostname", str(g_out)], env)
            g_host.append(g_out.read_bytes())

        guestfs_extract = [_timed(g_extract) for _ in range(guestfs_reps)]
        if hostname != g_host[-1] or listed[-1] != g_listed[-1]:
            raise RuntimeError(f"the two readers disagree: {hostname!r}/{g_host[-1]!r}, "
                               f"{listed[-1]}/{g_listed[-1]} entries in /etc")
        return {"image": kind, "layer_bytes": top.stat().st_size, "file_system": True, "etc_entries": listed[-1],
                "sandbox": {"list_s": sandbox_list, "extract_s": sandbox_extract,
                            "list_median_s": median(sandbox_list), "extract_median_s": median(sandbox_extract)},
                "libguestfs": {"list_s": guestfs_list, "extract_s": guestfs_extract,
                               "list_median_s": median(guestfs_list),
                               "extract_median_s": median(guestfs_extract)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", default="tiny,debian")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--guestfs-reps", type=int, default=2)
    ap.add_argument("--kvm", action="store_true", help="let libguestfs use KVM (default: TCG, as the tests)")
    args = ap.parse_args()
    results = [measure(k, args.reps, args.guestfs_reps, args.kvm) for k in args.images.split(",")]
    version = subprocess.run(["guestfish", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    path = write_result("backup_files", {"accel": "kvm" if args.kvm else "tcg", "libguestfs": version,
                                         "reps": args.reps, "guestfs_reps": args.guestfs_reps, "images": results})
    rows = []
    for r in results:
        for what in ("list", "extract", "refuse"):
            if f"{what}_median_s" in r["sandbox"]:
                rows.append([r["image"], what, f"{r['sandbox'][f'{what}_median_s']:.2f}",
                             f"{r['libguestfs'][f'{what}_median_s']:.2f}"])
    table("backup files: list /etc, extract /etc/hostname; no file system: the refusal (median s)",
          ["image", "call", "sandbox", "libguestfs"], rows)
    print(path)


if __name__ == "__main__":
    main()
