"""Pod checkpoint and restart in one Debian capsule, against the capsule's own whole-machine snapshot
in the same run (under TCG when the host has no KVM: the accel is in the result).

For pods holding ``--sizes`` MiB of incompressible memory (random bytes; the worst case for the image):
CRIU's dump in the guest, the image's copy out (on a lent disk from 16 MiB, else through the guest agent
in base64 chunks of 3 MiB), the whole checkpoint; the copy in (on a lent disk from 2 MiB, else 45 KiB
chunks: the agent's request lines are at most 64 KiB) and CRIU's restore; the image's size. The peer:
``capsule snapshot`` of the same capsule (memory image + disk layer, sealed), its time and the memory
image's allocated bytes. Ratios: pod / capsule. Where the guest's time went, per step, as the pod layer
reports it (``checkpoint_steps``: criu check, CRIU's dump, stopping the pod, packing the image;
``restore_steps``: unpacking, CRIU's restore, the network's unlock and announcement), where it does.

    .venv/bin/python bench/pods_bench.py [--sizes 10,50] [--memory 768M] [--result pods]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import table, temp_workdir, write_result  # noqa: E402
from capsule import capsules, images, lifecycle  # noqa: E402
from capsule.pod import ops  # noqa: E402
from capsule.store import Store  # noqa: E402
from testkit.images import IMAGE_HOME  # noqa: E402

HOLD = "import os, time\nb = os.urandom({mib} << 20)\nopen('/tmp/ready', 'w').write('1')\ntime.sleep(1e9)\n"


def wait_ready(store: Store, ref: str, timeout: float = 120.0) -> None:
    """Until the pod has filled its memory (its program writes /tmp/ready)."""
    deadline = time.monotonic() + timeout
    while ops.exec_in(store, ref, ["cat", "/tmp/ready"])["exit_code"] != 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"{ref} never filled its memory")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10,50", help="MiB of memory in each pod, comma-separated")
    ap.add_argument("--memory", default="768M", help="the capsule's memory")
    ap.add_argument("--images", default=str(IMAGE_HOME),
                    help="a store holding the debian image")
    ap.add_argument("--result", default="pods", help="the result's name: bench/results/NAME.json")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with temp_workdir("pods-bench-") as tmp:
        store = Store.open(Path(tmp) / "store")
        images.import_image(Store.open(Path(args.images)), store, "debian")
        capsules.create(store, "bench", "debian", memory=args.memory)
        started = lifecycle.start(store, "bench", timeout=300)
        rows, out = [], []
        try:
            for mib in sizes:
                ref = f"bench/p{mib}"
                ops.create(store, "bench", f"p{mib}", ["python3", "-c", HOLD.format(mib=mib)])
                wait_ready(store, ref)
                ck = ops.checkpoint(store, ref)
                back = ops.restore(store, ck.image, "bench")
                ops.kill(store, ref)
                r = {"mib": mib, "image_bytes": ck.size, "dump_s": ck.dump_seconds, "guest_s": ck.guest_seconds,
                     "copy_out_s": ck.copy_seconds, "checkpoint_s": ck.seconds, "copy_in_s": back["copy_seconds"],
                     "copy_in_calls": back["copy_calls"], "restore_s": back["seconds"],
                     "criu_restore_s": round(back["seconds"] - back["copy_seconds"], 3),
                     "out_mib_s": round(ck.size / 2**20 / ck.copy_seconds, 2),
                     "in_mib_s": round(ck.size / 2**20 / back["copy_seconds"], 2),
                     "checkpoint_steps": ck.guest_steps, "restore_steps": back.get("steps", {}),
                     "copy_out_route": ck.copy_route, "copy_in_route": back.get("copy_route", "file")}
                out.append(r)
                rows.append([mib, f"{ck.size / 2**20:.1f}", r["dump_s"], r["checkpoint_s"], r["copy_out_s"],
                             r["copy_in_s"], r["criu_restore_s"], r["restore_s"]])
            t0 = time.monotonic()
            snap, _ = lifecycle.snapshot(store, "bench")
            snap_s = time.monotonic() - t0
            mem = snap.memory.allocated if snap.memory else 0
        finally:
            lifecycle.stop(store, "bench", force=True, discard=True)
        for r in out:
            r["checkpoint_vs_snapshot"] = round(r["checkpoint_s"] / snap_s, 3)
            r["image_vs_memory_image"] = round(r["image_bytes"] / mem, 4) if mem else None
        table(f"pods in one capsule ({started.accel}); peer: capsule snapshot {snap_s:.2f} s, "
              f"memory image {mem / 2**20:.0f} MiB allocated",
              ["MiB", "image MiB", "dump s", "checkpoint s", "copy out s", "copy in s", "CRIU restore s",
               "restore s"], rows)
        path = write_result(args.result, {"accel": started.accel, "capsule_memory": args.memory, "pods": out,
                                     "snapshot_s": round(snap_s, 3), "memory_image_allocated": mem})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
