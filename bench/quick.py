"""The hot-path figures of the compiled extension in one table, a few minutes, no guest.

Measured side by side in one run, for this tree and (``--baseline REV``, default: the revision
before ``native/`` existed, the pure-Python code) for the older tree from ``git archive``:

* HCP over loopback of a 256 MiB memory-like file (zero, text-like, random and repeated pages)
  to a real agent: all-known (the receiver's hash cache primed with a copy) and all-novel (an empty
  store), beside ``zstd -3 -T1`` of the same file and a durable local copy of it (``cp
  --sparse=always`` + fsync: what any all-known receive must at least do, write the object) (goals:
  all-known >= 1.5 GB/s; all-novel >= 0.8 x zstd -3);
* verifying a 1 GiB qcow2 layer against its manifest (what ``capsule verify`` does per layer)
  beside BLAKE3 of the layer file, one thread and all threads (goal: >= 0.8 x BLAKE3 of the file);
* the disk server's cached reads (a 128 MiB layer whose blocks are all in its shadow) beside nbdkit's
  file plugin on the same data, ``qemu-img bench`` with 4 reads in flight of 4 KiB, 64 KiB and 1 MiB
  (goal: >= 0.9 x the file plugin at each size; bench/diskserver_measure.py, the tree's own).

    .venv/bin/python bench/quick.py [--size-mib 256] [--layer-mib 1024] [--baseline REV | --no-baseline]

Writes bench/results/quick.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 4096


def _image(path: Path, size: int, seed: int) -> None:
    """A memory-image-like file: 35% zero pages, 35% text-like, 20% random, 10% repeats."""
    rng = random.Random(seed)
    pages: list[bytes] = []
    with open(path, "wb") as f:
        for _ in range(size // BLOCK):
            r = rng.random()
            if r < 0.35:
                page = bytes(BLOCK)
            elif r < 0.70:
                line = b"%d pid=%d state=S comm=worker-%d\n" % (rng.randrange(10**12), rng.randrange(65536),
                                                                 rng.randrange(64))
                page = (line * (BLOCK // len(line) + 1))[:BLOCK]
            elif r < 0.90 or not pages:
                page = rng.randbytes(BLOCK)
            else:
                page = rng.choice(pages)
            if r >= 0.35 and len(pages) < 4096:
                pages.append(page)
            f.write(page)


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _blake3_file(path: Path, threads: int) -> float:
    from blake3 import blake3

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        t = time.perf_counter()
        blake3(m, max_threads=threads).digest()
        return time.perf_counter() - t


def _durable_copy(src: Path, dst: Path) -> float:
    """Seconds for ``cp --sparse=always`` of ``src`` plus an fsync of the copy (a local, durable copy)."""
    t = time.perf_counter()
    subprocess.run(["cp", "--sparse=always", str(src), str(dst)], check=True)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t
    dst.unlink()
    return seconds


def measure(root: Path, work: Path, size: int, layer_size: int) -> dict[str, float]:
    """Every figure for the tree at ``root`` (imported from there; agents started from there)."""
    sys.path.insert(0, str(root))
    from blake3 import blake3

    from capsule import transfer
    from capsule.agent.launch import AgentProcess
    from capsule.agentclient import AgentClient
    from capsule.qemuimg import convert_raw_to_layer
    from capsule.store import Store
    from capsule.transfer import pushpull
    from hashcache.manifest import manifest_of_layer, verify_layer

    env = dict(os.environ, PYTHONPATH=str(root))
    a, c, d = (Store.open(work / n) for n in ("a", "c", "d"))
    img = work / "image"
    _image(img, size, seed=7)
    shutil.copyfile(img, work / "copy-of-image")
    row = a.seal_file(img, "memory")
    a.catalogue.add_file(row)
    d.hash_cache().prime_paths([work / "copy-of-image"])
    c.close()
    d.close()
    out: dict[str, float] = {}
    raw = a.file_manifest(row.id).stored_bytes
    agents = [AgentProcess(s.home, work / f"{s.home.name}.token", env=env) for s in (c, d)]
    try:
        for agent, key in zip(agents, ("hcp_all_novel", "hcp_all_known"), strict=True):
            with AgentClient(agent.url, agent.token) as client:
                t = time.perf_counter()
                report = pushpull._push_object(a, client, "file", row.id, "memory", transfer.Options(),
                                               transfer.Progress())
                seconds = time.perf_counter() - t
            out[f"{key}_MBps"] = raw / seconds / 1e6
            out[f"{key}_fetched_MiB"] = report.fetched_bytes / 2**20 if report else -1.0
    finally:
        for agent in agents:
            agent.stop()
    path = a.file_path(row.id)
    t = _timed(lambda: subprocess.run(["zstd", "-3", "-T1", "-q", "-f", "-o", str(work / "i.zst"), str(path)],
                                      check=True))
    out["zstd3_MBps"] = path.stat().st_size / t / 1e6
    # the floor of an all-known receive: the receiver must still write the object durably
    out["durable_copy_MBps"] = raw / min(_durable_copy(path, work / f"cp{k}") for k in range(2)) / 1e6
    # a fully allocated 1 GiB layer
    raw_disk = work / "disk.raw"
    _image(raw_disk, layer_size, seed=11)
    layer = work / "layer.qcow2"
    convert_raw_to_layer(raw_disk, layer)
    raw_disk.unlink()
    m = manifest_of_layer(layer, None)  # also brings the file into the page cache
    t = min(_timed(lambda: verify_layer(layer, m, "bench")) for _ in range(2))
    out["verify_layer_MBps"] = layer_size / t / 1e6
    file_size = layer.stat().st_size
    out["blake3_file_1thread_MBps"] = file_size / min(_blake3_file(layer, 1) for _ in range(2)) / 1e6
    out["blake3_file_all_threads_MBps"] = file_size / min(_blake3_file(layer, blake3.AUTO) for _ in range(2)) / 1e6
    a.close()
    from bench import diskserver_measure  # the tree's own: what its disk server runs is what it measures

    (work / "ds").mkdir()
    tp = diskserver_measure.bench_throughput(work / "ds", 128, 4, 5)  # as bench/diskserver_micro.py measures
    for request, key in (("4k", "qemu_img_bench_4k"), ("64k", "qemu_img_bench_64k"), ("1m", "qemu_img_bench")):
        if f"{key}_MBps" in tp["diskserver"]:
            out[f"diskserver_{request}_MBps"] = tp["diskserver"][f"{key}_MBps"]
            out[f"nbdkit_file_{request}_MBps"] = tp["file_plugin"][f"{key}_MBps"]
    return {k: round(v, 1) for k, v in out.items()}


def _first_native_revision() -> str | None:
    try:
        revs = subprocess.run(["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%H", "--",
                               "native/Cargo.toml"], check=True, capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{revs[-1]}^" if revs else None


def _run_tree(root: Path, args: argparse.Namespace) -> dict[str, float]:
    """The measurement in a fresh interpreter that imports the tree at ``root``."""
    work = Path(tempfile.mkdtemp(prefix="capsule-quick-"))
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--inner", str(root), "--work", str(work),
                            "--size-mib", str(args.size_mib), "--layer-mib", str(args.layer_mib)],
                           check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(root)))
        return json.loads(r.stdout.strip().splitlines()[-1])
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"measuring {root} failed:\n{exc.stderr}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256, help="size of the memory-like file sent by HCP")
    ap.add_argument("--layer-mib", type=int, default=1024, help="virtual size of the verified layer")
    ap.add_argument("--baseline", default=None, help="git revision to compare with (default: before native/)")
    ap.add_argument("--no-baseline", action="store_true", help="measure this tree only")
    ap.add_argument("--inner", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        print(json.dumps(measure(args.inner, args.work, args.size_mib << 20, args.layer_mib << 20)))
        return
    sys.path.insert(0, str(ROOT))
    from bench.common import table, write_result

    trees = {"now": ROOT}
    base_dir: Path | None = None
    rev = None if args.no_baseline else (args.baseline or _first_native_revision())
    if rev:
        base_dir = Path(tempfile.mkdtemp(prefix="capsule-quick-base-"))
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_dir)], input=archive, check=True)
        trees = {"before": base_dir, "now": ROOT}
    try:
        figures = {label: _run_tree(root, args) for label, root in trees.items()}
    finally:
        if base_dir:
            shutil.rmtree(base_dir, ignore_errors=True)
    for f in figures.values():
        f["all_novel_vs_zstd3"] = round(f["hcp_all_novel_MBps"] / f["zstd3_MBps"], 3)
        f["all_known_vs_durable_copy"] = round(f["hcp_all_known_MBps"] / f["durable_copy_MBps"], 3)
        f["verify_vs_blake3_1thread"] = round(f["verify_layer_MBps"] / f["blake3_file_1thread_MBps"], 3)
        f["verify_vs_blake3_all_threads"] = round(f["verify_layer_MBps"] / f["blake3_file_all_threads_MBps"], 3)
        for size in ("4k", "64k", "1m"):
            if f"diskserver_{size}_MBps" in f:
                ratio = f[f"diskserver_{size}_MBps"] / f[f"nbdkit_file_{size}_MBps"]
                f[f"diskserver_vs_nbdkit_file_{size}"] = round(ratio, 3)
    goals = {"hcp_all_known_MBps": ">= 1500", "all_novel_vs_zstd3": ">= 0.8", "verify_vs_blake3_1thread": ">= 0.8",
             "verify_vs_blake3_all_threads": ">= 0.8", "diskserver_vs_nbdkit_file_4k": ">= 0.9",
             "diskserver_vs_nbdkit_file_64k": ">= 0.9", "diskserver_vs_nbdkit_file_1m": ">= 0.9"}
    keys = list(dict.fromkeys(k for f in figures.values() for k in f))
    rows = [[key, *(f.get(key, "—") for f in figures.values()), goals.get(key, "")] for key in keys]
    result = {"baseline_revision": rev, "size_mib": args.size_mib, "layer_mib": args.layer_mib, "cores": os.cpu_count(),
              "figures": figures,
              "goals": goals}
    path = write_result("quick", result)
    table(f"hot paths: {args.size_mib} MiB memory-like file by HCP on loopback, {args.layer_mib} MiB layer verified",
          ["figure", *figures, "goal"], rows)
    print(f"→ {path}")


if __name__ == "__main__":
    main()
