"""The disk server's micro figures (bench/diskserver_measure.py), kept in bench/results/diskserver_micro.json:
cached throughput vs nbdkit's file plugin on the same data (goal >= 0.9x; the disk server with its native
read path, and the Python plugin alone), per-miss latency on loopback
(goal <= 200 us), read amplification of random 4 KiB reads (goal <= 1.1x).

    .venv/bin/python bench/diskserver_micro.py [--size-mib 128] [--misses 400]
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import diskserver_measure  # noqa: E402
from bench.common import table, write_result  # noqa: E402


def main() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        diskserver_measure.main(sys.argv[1:])
    result = json.loads(out.getvalue())
    path = write_result("diskserver_micro", result)
    tp, lat = result.get("throughput", {}), result.get("latency", {})
    rows = [[f"cached reads, {what}", tp.get("diskserver", {}).get(key),
             tp.get("diskserver_plugin_only", {}).get(key), tp.get("file_plugin", {}).get(key),
             tp.get(f"ratio_{key.removesuffix('_MBps')}"), tp.get(f"ratio_{key.removesuffix('_MBps')}_plugin_only")]
            for what, key in (("1 MiB x4 in flight", "qemu_img_bench_MBps"),
                              ("64 KiB x4 in flight", "qemu_img_bench_64k_MBps"),
                              ("4 KiB x4 in flight", "qemu_img_bench_4k_MBps"),
                              ("qemu-img convert", "qemu_img_convert_MBps"))]
    table("Disk server: cached throughput (MB/s)", ["reads", "disk server", "plugin alone", "nbdkit file",
                                                    "ratio (goal >= 0.9)", "ratio, plugin alone"], rows)
    if "write_behind" in lat:
        wb = lat["write_behind"]
        table("Disk server: misses on loopback", ["figure", "value"], [
            ["miss, median (goal <= 200 us)", f"{wb['miss']['median_us']} us"],
            ["hit, median", f"{wb['hit']['median_us']} us"],
            ["bare READ of one block (the agent's share)", f"{lat['hcp_read_1_block']['median_us']} us"],
            ["read amplification (goal <= 1.1)", wb["read_amplification"]]])
    print(f"→ {path}")


if __name__ == "__main__":
    main()
