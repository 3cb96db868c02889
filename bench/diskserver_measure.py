"""Disk server micro-benchmarks; prints one JSON object.

1. **Cached throughput**: a random-data qcow2 layer (``--size-mib``, default 128) served as a *remote*
   layer whose shadow is complete (as after a prefetch; the source URL points nowhere and is never
   used), read sequentially by QEMU's tools through nbdkit + the Python plugin; the same data as a
   raw file through nbdkit's ``file`` plugin is the peer. Figures: ``qemu-img bench`` (1 MiB
   requests, 4 in flight, the image read ``--passes`` times; and 64 KiB requests, 4 in flight, as many passes) and
   ``qemu-img convert`` to a null target. Goal: ratio >= 0.7.
2. **Per-miss latency** on loopback: a real agent (``capsule serve``, started here on
   ``--agent-store``, default the test image store) serves its largest layer; a cold chain reads
   random 4 KiB blocks through nbdkit with a minimal NBD client, one request at a time. Reported
   next to the same reads once shadowed (hits), and to a bare HCP READ of one block (the agent's
   share). Goal: <= 200 us.
3. **Read amplification** of those random 4 KiB reads: bytes fetched from the source / bytes read.
   Goal: <= 1.1.

Run: ``.venv/bin/python bench/diskserver_measure.py [--size-mib 128] [--misses 400] [--skip-latency]``
(``bench/diskserver_micro.py`` runs it, prints tables and keeps the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from capsule.agent.launch import AgentProcess  # noqa: E402
from diskserver.chain import Chain, ChainSpec, LayerSpec, ReadaheadSpec, RemoteSpec, RetrySpec  # noqa: E402
from diskserver.nbdclient import NbdClient, probe  # noqa: E402
from diskserver.server import DiskServer  # noqa: E402
from diskserver.source import HcpSource  # noqa: E402
from hashcache.blocks import BLOCK_SIZE  # noqa: E402
from hashcache.manifest import Manifest, manifest_of_layer  # noqa: E402
from hashcache.qcow2 import DATA, Qcow2Image  # noqa: E402
from hashcache.shadow import Shadow  # noqa: E402
from testkit.images import IMAGE_HOME  # noqa: E402


def _run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - t0


def _best(cmd: list[str], repeat: int) -> float:
    return min(_run(cmd) for _ in range(repeat))


def _read_tools(uri: str, size: int, passes: int, repeat: int) -> dict[str, float]:
    mib = 1 << 20
    count = size // mib * passes
    bench = _best(["qemu-img", "bench", "-f", "raw", "-c", str(count), "-d", "4", "-s", "1M", uri], repeat)
    # as many passes as the 1 MiB bench: one pass of 64 KiB reads is over in tens of milliseconds, about
    # what starting qemu-img costs, which would then dominate both figures
    small = _best(["qemu-img", "bench", "-f", "raw", "-c", str(size // 65536 * passes), "-d", "4", "-s", "64k", uri],
                  repeat)
    # 4 KiB reads: a quarter of the image per pass (a whole one would take minutes through the plugin alone)
    tiny = _best(["qemu-img", "bench", "-f", "raw", "-c", str(size // 4 // 4096 * passes), "-d", "4", "-s", "4k",
                  uri], repeat)
    conv = _best(["qemu-img", "convert", "-n", "-f", "raw", uri, "--target-image-opts",
                  f"driver=null-co,size={size}"], repeat)
    return {"qemu_img_bench_MBps": round(count * mib / bench / 1e6, 1),
            "qemu_img_bench_64k_MBps": round(size * passes / small / 1e6, 1),
            "qemu_img_bench_4k_MBps": round(size // 4 * passes / tiny / 1e6, 1),
            "qemu_img_convert_MBps": round(size / conv / 1e6, 1)}


def _file_plugin(raw: Path, sock: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["nbdkit", "--foreground", "--readonly", "--exit-with-parent", "--unix", str(sock),
                             "file", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not (sock.exists() and probe(str(sock))):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("nbdkit file plugin did not start")
        time.sleep(0.02)
    return proc


def bench_throughput(work: Path, size_mib: int, passes: int, repeat: int) -> dict[str, Any]:
    size = size_mib << 20
    raw = work / "data.raw"
    with open(raw, "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(1 << 20))
    layer = work / "layer.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(layer)], check=True)
    m = manifest_of_layer(layer, None)
    m.write(work / "layer.manifest")
    token = work / "token"
    token.write_text("x" * 32)
    shadows = work / "shadows"
    with Shadow(shadows / m.digest, m.block_count) as sh, Qcow2Image(layer) as img:  # a completed prefetch
        for run in img.iter_block_runs(max_blocks=2048):
            if run.kind is DATA:
                data = img.read_run(run)
                sh.store([(run.start + k, data[k * BLOCK_SIZE:(k + 1) * BLOCK_SIZE]) for k in range(run.count)])
    spec = ChainSpec(layers=(LayerSpec(id=m.digest, manifest_path=str(work / "layer.manifest"),
                                       remote=RemoteSpec("http://127.0.0.1:9", str(token))),),
                     shadow_dir=str(shadows), retry=RetrySpec(seconds=0.5))
    spec.save(work / "spec.json")
    sockdir = Path(tempfile.mkdtemp(prefix="dsb-", dir="/tmp"))
    out: dict[str, Any] = {"size_mib": size_mib}
    try:
        proc = _file_plugin(raw, sockdir / "file.sock")
        try:
            out["file_plugin"] = _read_tools(f"nbd+unix:///?socket={sockdir / 'file.sock'}", size, passes, repeat)
        finally:
            proc.terminate()
            proc.wait()
        # the disk server as it runs (the native read path in front of the plugin), then the plugin alone
        for name, native in (("diskserver", True), ("diskserver_plugin_only", False)):
            with DiskServer(work / "spec.json", sockdir / "ds.sock", work / f"{name}.log", exit_with_parent=True,
                            native=native) as server:
                if native and not any(a.startswith("--filter=") for a in server.command()):
                    raise RuntimeError("the native read path is not built (make native)")
                out[name] = _read_tools(server.uri, size, passes, repeat)
            stats = server.stats() or {}
            out[f"{name}_fetched_bytes"] = stats.get("source_bytes")
            if native:
                out["native_share"] = round(stats.get("native_reads", 0) / max(1, stats.get("requests", 0)), 4)
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
    for key in ("qemu_img_bench_MBps", "qemu_img_bench_64k_MBps", "qemu_img_bench_4k_MBps", "qemu_img_convert_MBps"):
        short = key.removesuffix("_MBps")
        out[f"ratio_{short}"] = round(out["diskserver"][key] / out["file_plugin"][key], 3)
        out[f"ratio_{short}_plugin_only"] = round(out["diskserver_plugin_only"][key] / out["file_plugin"][key], 3)
    return out


# -- latency and amplification -----------------------------------------------------------------------


def _pick_layer(store: Path, which: str) -> tuple[str, Path]:
    manifests = sorted((store / "layers").glob("*.manifest"), key=lambda p: p.stat().st_size)
    if not manifests:
        raise RuntimeError(f"no layer manifests in {store}/layers")
    best = manifests[-1] if which == "largest" else manifests[0]
    return best.name.removesuffix(".manifest"), best


def _summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"n": len(s), "median_us": round(statistics.median(s) * 1e6, 1),
            "mean_us": round(statistics.fmean(s) * 1e6, 1), "p90_us": round(s[int(len(s) * 0.9)] * 1e6, 1),
            "min_us": round(s[0] * 1e6, 1)}


def _timed_reads(sock: Path, offsets: list[int]) -> list[float]:
    out = []
    with NbdClient(str(sock)) as nbd:
        for off in offsets:
            t0 = time.perf_counter()
            nbd.pread(off, BLOCK_SIZE)
            out.append(time.perf_counter() - t0)
    return out


def bench_latency(work: Path, store: Path, misses: int, which: str) -> dict[str, Any]:
    layer_id, manifest_path = _pick_layer(store, which)
    m = Manifest.read(manifest_path)
    data = [i for i, z, _h in m.records() if not z]
    rng = random.Random(42)
    picks = rng.sample(data, min(misses, len(data)))
    offsets = [i * BLOCK_SIZE for i in picks]
    token = work / "agent.token"
    # plain HTTP on loopback, as these figures were first measured (`capsule serve` defaults to TLS)
    agent = AgentProcess(store, token)
    url = agent.url
    out: dict[str, Any] = {"layer": layer_id[:12], "layer_data_blocks": len(data)}
    sockdir = Path(tempfile.mkdtemp(prefix="dsl-", dir="/tmp"))
    try:
        # the agent's share: one bare HCP READ of one block per call
        src = HcpSource(url, token, compress=True, level=1)
        hcp = []
        for i in rng.sample(data, min(200, len(data))):
            t0 = time.perf_counter()
            src.read_blocks(layer_id, [i])
            hcp.append(time.perf_counter() - t0)
        src.close()
        out["hcp_read_1_block"] = _summary(hcp)
        for mode, write_behind in (("write_behind", True), ("synchronous_store", False)):
            shadows = work / f"shadows-{mode}"
            spec = ChainSpec(layers=(LayerSpec(id=layer_id, manifest_path=str(manifest_path),
                                               remote=RemoteSpec(url, str(token))),),
                             shadow_dir=str(shadows), write_behind=write_behind, stats_interval=0.2)
            spec.save(work / f"{mode}.json")
            with DiskServer(work / f"{mode}.json", sockdir / f"{mode}.sock", work / f"{mode}.log",
                            exit_with_parent=True) as server:
                cold = _timed_reads(server.socket_path, offsets)
                hot = _timed_reads(server.socket_path, offsets)
            stats = server.stats() or {}
            out[mode] = {"miss": _summary(cold), "hit": _summary(hot),
                         "read_amplification": round(stats["source_bytes"] / (len(offsets) * BLOCK_SIZE), 4),
                         "fetch_requests": stats["fetch_requests"], "source_blocks": stats["source_blocks"],
                         "wire_bytes": stats["wire_bytes"]}
        # in process, without nbdkit: what the chain itself adds to a miss
        spec = ChainSpec(layers=(LayerSpec(id=layer_id, manifest_path=str(manifest_path),
                                           remote=RemoteSpec(url, str(token))),),
                         shadow_dir=str(work / "shadows-inproc"), readahead=ReadaheadSpec(0, 0))
        with Chain.open(spec) as chain:
            t = []
            for off in offsets:
                t0 = time.perf_counter()
                chain.read(off, BLOCK_SIZE)
                t.append(time.perf_counter() - t0)
        out["in_process_miss"] = _summary(t)
    finally:
        agent.stop()
        shutil.rmtree(sockdir, ignore_errors=True)
    wb = out["write_behind"]
    out["miss_minus_hcp_median_us"] = round(wb["miss"]["median_us"] - out["hcp_read_1_block"]["median_us"], 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=128)
    p.add_argument("--passes", type=int, default=4, help="qemu-img bench reads the image this many times")
    p.add_argument("--repeat", type=int, default=5, help="best of this many runs per figure")
    p.add_argument("--misses", type=int, default=400)
    p.add_argument("--agent-store", type=Path, default=IMAGE_HOME)
    p.add_argument("--layer", choices=("smallest", "largest"), default="smallest",
                   help="which layer of the agent's store to fetch from")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="diskserver-bench-", dir=args.workdir))
    result: dict[str, Any] = {}
    try:
        if not args.skip_throughput:
            (work / "tp").mkdir()
            result["throughput"] = bench_throughput(work / "tp", args.size_mib, args.passes, args.repeat)
        if not args.skip_latency:
            if (args.agent_store / "layers").is_dir():
                (work / "lat").mkdir()
                result["latency"] = bench_latency(work / "lat", args.agent_store, args.misses, args.layer)
            else:
                result["latency"] = {"skipped": f"no store at {args.agent_store}"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
