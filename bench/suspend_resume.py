"""Suspend and resume latency of a 256 MiB capsule against plain
`virsh save` / `virsh restore` of the same domain, in the same run.

Capsule's suspend = libvirt sparse save + sealing (hashing the memory image
and the leaf, manifests) + catalogue; its resume = integrity checks + leaf
creation + restore. The peer is `virsh save` / `virsh restore` of the same
running guest (default and sparse image formats). Ratios are medians over
rounds. Also reports memory-image allocated bytes against RAM.

    .venv/bin/python bench/suspend_resume.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, table, temp_workdir, tiny_stores, write_result  # noqa: E402
from capsule import capsules, lifecycle  # noqa: E402
from capsule.runtime.connection import libvirt_uri  # noqa: E402

TOUCH = "(i=0; : > /tmp/count; while true; do i=$((i+1)); echo $i 1<> /tmp/count; sleep 0.2; done) >/dev/null 2>&1 &"


def virsh(*args: str) -> float:
    t = time.monotonic()
    subprocess.run(["virsh", "-q", "-c", libvirt_uri(), *args], check=True, capture_output=True)
    return time.monotonic() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with temp_workdir("capsule-bench-") as tmp:
        [store] = tiny_stores(Path(tmp) / "store")
        capsules.create(store, "bench", "tiny", memory="256M")
        lifecycle.start(store, "bench")
        from capsule.console.serial import ConsoleSession

        with ConsoleSession(store.domain_name("bench")) as c:
            c.run(TOUCH)
        dom = store.domain_name("bench")
        rows: dict[str, list[float]] = {k: [] for k in (
            "capsule_suspend", "capsule_resume", "virsh_save", "virsh_restore",
            "virsh_save_sparse", "virsh_restore_sparse")}
        mem_alloc = mem_size = 0
        for _ in range(args.rounds):
            r = lifecycle.suspend(store, "bench")
            assert r.memory is not None   # a suspend records a memory image
            t = time.monotonic()
            s = lifecycle.start(store, "bench")
            rows["capsule_resume"].append(time.monotonic() - t)
            assert s.mode == "restore"
            rows["capsule_suspend"].append(r.save_seconds + r.seal_seconds)
            mem_alloc, mem_size = r.memory.allocated, r.memory.size
            for fmt, key in (("raw", "virsh_save"), ("sparse", "virsh_save_sparse")):
                f = Path(tmp) / f"peer-{fmt}.save"
                rows[key].append(virsh("save", dom, str(f), "--image-format", fmt))
                rows[key.replace("save", "restore")].append(virsh("restore", str(f)))
                f.unlink()
        med = {k: median(v) for k, v in rows.items()}
        ratio_suspend = med["capsule_suspend"] / med["virsh_save_sparse"]
        ratio_resume = med["capsule_resume"] / med["virsh_restore_sparse"]
        result = {
            "rounds": args.rounds, "ram_bytes": 256 << 20,
            "memory_image_bytes": mem_size, "memory_image_allocated": mem_alloc,
            "allocated_vs_ram": round(mem_alloc / (256 << 20), 3),
            "median_seconds": {k: round(v, 3) for k, v in med.items()},
            "ratio_suspend_vs_virsh_save_sparse": round(ratio_suspend, 3),
            "ratio_resume_vs_virsh_restore_sparse": round(ratio_resume, 3),
            "ratio_suspend_vs_virsh_save_raw": round(med["capsule_suspend"] / med["virsh_save"], 3),
            "ratio_resume_vs_virsh_restore_raw": round(med["capsule_resume"] / med["virsh_restore"], 3),
            "goal": "ratios <= 1.2",
        }
        lifecycle.stop(store, "bench", force=True)
        path = write_result("suspend_resume", result)
        table("suspend / resume, 256 MiB guest (median s)", ["operation", "capsule", "virsh sparse", "virsh raw",
                                                             "ratio vs sparse"],
              [["suspend", f"{med['capsule_suspend']:.3f}", f"{med['virsh_save_sparse']:.3f}",
                f"{med['virsh_save']:.3f}", f"{ratio_suspend:.2f}"],
               ["resume", f"{med['capsule_resume']:.3f}", f"{med['virsh_restore_sparse']:.3f}",
                f"{med['virsh_restore']:.3f}", f"{ratio_resume:.2f}"]])
        print(f"memory image: {mem_alloc / 2**20:.1f} MiB allocated of {mem_size / 2**20:.1f} MiB "
              f"({result['allocated_vs_ram']:.0%} of RAM)  → {path}")


if __name__ == "__main__":
    main()
