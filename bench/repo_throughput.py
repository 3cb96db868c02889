"""B5's throughput: `capsule repo push` against `restic backup` of the same data, to the same SeaweedFS S3 endpoint
on loopback (one cluster: a master, two volume servers, a filer and its S3 gateway).

The data is one capsule version's memory image of ``--mib`` MiB, 1 MiB pieces alternating between random bytes
and text (as compressible as prose): each tool stores it in a fresh repository, taking turns, ``--runs`` times.
Capsule's push is the CLI (`capsule repo push NAME@V URL`), restic's is `restic backup FILE` on the very file the
version holds, each timed as a process from start to exit; both hash, compress, encrypt and upload. The result is
each one's MB/s (10^6 bytes) and their ratio, median of the runs (`bench/results/repo_throughput.json`).

    .venv/bin/python bench/repo_throughput.py [--mib 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import image_stores, median, table, workdir, write_result  # noqa: E402
from bench.repo_vs_restic import BUCKET, PASS, Restic, restic_version  # noqa: E402
from capsule.store import Store  # noqa: E402
from testkit.fleetkit import with_memory  # noqa: E402
from testkit.payloads import text  # noqa: E402
from testkit.seaweedfs import SeaweedCluster  # noqa: E402

MB = 1e6
GOAL = 0.8       # Capsule's throughput at least this × restic's


def bulk(store: Store, name: str, mib: int) -> tuple[str, Path]:
    """Capsule ``name`` (tiny image) with a new version whose memory image is ``mib`` MiB of alternating random and
    text pieces; its ref and the memory image's path."""
    from capsule import capsules

    capsules.create(store, name, "tiny")
    rng = random.Random(5)
    ref = with_memory(store, name, b"".join(rng.randbytes(1 << 20) if i % 2 == 0 else text(1 << 20, seed=i)
                                             for i in range(mib)))
    v = store.catalogue.version(name, int(ref.rsplit("@", 1)[1]))
    assert v is not None and v.memory is not None
    return ref, store.file_path(v.memory)


def capsule_push(store: Store, ref: str, url: str, env: dict[str, str]) -> float:
    """Seconds of `capsule repo init` excluded, `capsule repo push` included."""
    cli = [sys.executable, "-m", "capsule.cli.main", "--home", str(store.home)]
    subprocess.run([*cli, "repo", "init", url], check=True, capture_output=True, env=env)
    t0 = time.monotonic()
    subprocess.run([*cli, "repo", "push", ref, url], check=True, capture_output=True, env=env)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="MiB of data (default 256)")
    ap.add_argument("--runs", type=int, default=3, help="pushes of each tool, taking turns (default 3)")
    args = ap.parse_args()
    if shutil.which("restic") is None:
        sys.exit("the peer needs restic: apt-get install restic")
    work = workdir("capsule-b5t-")
    cluster = SeaweedCluster(work / "seaweedfs")
    runs: list[dict[str, Any]] = []
    try:
        cluster.start()
        [store] = image_stores("tiny", work / "a")
        ref, memory = bulk(store, "bulk", args.mib)
        size = memory.stat().st_size
        env = {**os.environ, **cluster.env(), "CAPSULE_REPO_PASSPHRASE": PASS.decode()}
        for i in range(args.runs):
            for way in (("capsule", "restic") if i % 2 == 0 else ("restic", "capsule")):
                if way == "capsule":
                    seconds = capsule_push(store, ref, cluster.url(BUCKET, f"capsule{i}"), env)
                else:
                    seconds = Restic(cluster, f"restic{i}", work).backup(memory)["seconds"]
                runs.append({"run": i, "tool": way, "seconds": round(seconds, 2),
                             "mb_per_s": round(size / MB / seconds, 1)})
                print(f"run {i + 1} {way}: {seconds:.1f} s, {size / MB / seconds:.1f} MB/s", flush=True)
        store.close()
    finally:
        cluster.remove()
        shutil.rmtree(work, ignore_errors=True)

    med = {tool: median([r["mb_per_s"] for r in runs if r["tool"] == tool]) for tool in ("capsule", "restic")}
    ratio = round(med["capsule"] / med["restic"], 3)
    result = {"bytes": size, "runs": runs, "restic": restic_version(), "median_mb_per_s": med,
              "capsule_over_restic": ratio, "goal": GOAL, "met": ratio >= GOAL,
              "data": "1 MiB pieces alternating random and text; one memory image file"}
    path = write_result("repo_throughput", result)
    table(f"{size / MB:.0f} MB to one SeaweedFS S3 endpoint on loopback, median of {args.runs} (MB/s)",
          ["capsule repo push", "restic backup", "capsule ÷ restic"],
          [[f"{med['capsule']:.1f}", f"{med['restic']:.1f}", f"{ratio:.2f} (goal ≥ {GOAL})"]])
    print(f"→ {path}")


if __name__ == "__main__":
    main()
