"""B5 on B4's series: a working desktop backed up every minute, then daily, stored three ways.

The guest and its work are B4's (``bench/backup_series.py``): the Debian capsule (512 MiB) running a
scripted office day (``bench/office_workload.py``: documents edited, a small project rebuilt, a local web
server browsed with a disk and a memory cache). It is snapshotted as the backup job does (ballooned first,
policy ``cache``):

- every minute for ``--minutes`` (30) minutes, snapshot 0 half a minute after the work starts;
- then ``--days`` (30) simulated dailies: before each, the guest takes in a day's new files (``--day-mib``,
  16 MiB: half random bytes, as photos or archives are, half text) in ``/root/days``, drops the files of the
  day a week before, and works on for ``--day-seconds`` (10).

Each snapshot is stored three ways on one SeaweedFS cluster (``bench.repo_vs_restic.ThreeWays``): Capsule's
repository over S3, restic 0.14 from Debian (the same disk flattened to a raw image, the memory image, kernel
and initrd), and Capsule's host-to-host copy of today (HCP to a backup host's agent that holds the image).
Figures per snapshot as in ``bench/repo_vs_restic.py``: bucket growth, uploaded bytes, seconds (indicative:
the guest runs beside the stores on the same two cores).

    .venv/bin/python bench/repo_desktop_series.py [--minutes 30] [--days 30] [--day-mib 16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.backup_series import NAME, start_workload  # noqa: E402
from bench.common import write_result  # noqa: E402
from bench.repo_vs_restic import (  # noqa: E402
    ThreeWays,
    bucket_bytes,
    goals,
    restic_version,
    seaweed_workdir,
    series_table,
    source_and_ways,
    totals,
)
from capsule import capsules, lifecycle  # noqa: E402
from capsule.console.serial import ConsoleSession  # noqa: E402
from capsule.runtime.guestagent import wait_for_agent  # noqa: E402
from testkit.seaweedfs import SeaweedCluster  # noqa: E402


def a_day(day: int, mib: int) -> str:
    """The guest's new files of simulated day ``day``, and the files of a week before removed."""
    half = mib * 1048576 // 2
    return (f"mkdir -p /root/days && head -c {half} /dev/urandom > /root/days/d{day}.bin && "
            f"cat /usr/share/common-licenses/* /usr/share/doc/*/copyright 2>/dev/null | "
            f"sed 's/^/day {day}: /' | head -c {half} > /root/days/d{day}.txt; "
            f"rm -f /root/days/d{day - 7}.*; sync; echo ok")


def snapshot(a: Any, ways: ThreeWays, label: str, index: int, t_start: float) -> dict[str, Any]:
    t0 = time.monotonic()
    sealed, resumed = lifecycle.snapshot(a, NAME, balloon="cache", note=f"b5 {label}")
    v = sealed.version
    assert v is not None
    row = {"snapshot": index, "label": label, "version": v.number, "at_seconds": round(t0 - t_start, 1),
           "snapshot_seconds": round(time.monotonic() - t0, 2),
           "pause_seconds": round(sealed.save_seconds + sealed.seal_seconds + resumed.seconds, 2)}
    print(f"snapshot {index} ({label}, v{v.number}):", flush=True)
    return {**row, **ways.store(a, v)}


def run(args: argparse.Namespace, work: Path, cluster: SeaweedCluster) -> tuple[list[dict[str, Any]], int]:
    with source_and_ways("debian", work, cluster) as (a, ways):
        capsules.create(a, NAME, "debian", memory=args.memory)
        lifecycle.start(a, NAME, timeout=300)
        wait_for_agent(a.instance_dir(NAME) / "agent.sock", timeout=120)
        start_workload(a)
        rows: list[dict[str, Any]] = []
        t_start = time.monotonic() + 30
        for i in range(args.minutes + 1):
            time.sleep(max(0.0, t_start + 60 * i - time.monotonic()))
            rows.append(snapshot(a, ways, f"minute {i}", len(rows), t_start))
        for day in range(1, args.days + 1):
            with ConsoleSession(a.domain_name(NAME)) as c:
                c.run(a_day(day, args.day_mib), timeout=300)
            time.sleep(args.day_seconds)
            rows.append(snapshot(a, ways, f"day {day}", len(rows), t_start))
        lifecycle.stop(a, NAME, force=True)
        return rows, bucket_bytes(ways.client, "capsule")[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=int, default=30, help="minutely snapshots after the first (default 30)")
    ap.add_argument("--days", type=int, default=30, help="simulated dailies after them (default 30)")
    ap.add_argument("--day-mib", type=int, default=16, help="MiB of new files a simulated day brings")
    ap.add_argument("--day-seconds", type=float, default=10.0, help="seconds the guest works between dailies")
    ap.add_argument("--memory", default="512M", help="the guest's memory (default 512M, as B4)")
    args = ap.parse_args()
    if shutil.which("restic") is None:
        sys.exit("the restic peer needs restic: apt-get install restic")
    with seaweed_workdir("capsule-b5d-") as (work, cluster):
        rows, objects = run(args, work, cluster)
        tot = totals(rows)
        result = {"guest": "debian with B4's office workload", "memory": args.memory, "minutes": args.minutes,
                  "days": args.days, "day_mib": args.day_mib, "day_seconds": args.day_seconds,
                  "restic": restic_version(), "series": rows, "totals": tot, "capsule_repo_objects": objects,
                  "goals": goals(rows, tot),
                  "note": "MB = 10^6 bytes; seconds measured while the guest ran on the same cores"}
        path = write_result("repo_desktop_series", result)
        series_table(rows, tot)
        print(f"→ {path}")


if __name__ == "__main__":
    main()
