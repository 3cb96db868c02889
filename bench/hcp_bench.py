"""HCP figures (issue: hashed copy), measured side by side in one run.

1. Loopback throughput of a memory image: all-novel (receiver has nothing)
   and all-known (receiver's hash cache primed with a copy), beside
   `zstd -3` of the same file and a plain copy.
2. Bytes on the wire to push a new version (memory image + child layer) over
   a shaped link (default: the paper's DSL, 384 kbit/s, 20 ms RTT) when the
   receiver holds the previous version: HCP vs `zstd -3` of each object vs
   `rsync -z` of the same file against the previous version. Goal: HCP wire
   bytes <= 1.02 x zstd(novel blocks) + 32 bytes per block; time <= 1.05 x
   bytes / link rate. The same push with ``--no-like`` (the memory image's manifest on its own, not against
   the previous version's, which the receiver holds) to a second receiver in the same state, same link.

    .venv/bin/python bench/hcp_bench.py [--rate-kbit 384] [--rtt-ms 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zstandard  # noqa: E402

from bench.common import table, workdir, write_result  # noqa: E402
from capsule import capsules, images, lifecycle, transfer  # noqa: E402
from capsule.agent.launch import AgentProcess  # noqa: E402
from capsule.console.serial import ConsoleSession  # noqa: E402
from capsule.store import Store  # noqa: E402
from testkit.images import IMAGE_HOME  # noqa: E402
from testkit.netlink import SlowLink  # noqa: E402

CAPSULE = [sys.executable, "-m", "capsule.cli.main"]


def guest(store: Store, cmd: str) -> str:
    with ConsoleSession(store.domain_name("bench")) as c:
        return c.run(cmd, timeout=300)


def timed(cmd: list[str]) -> float:
    t = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - t


def zstd_size(path: Path) -> int:
    out = subprocess.run(["zstd", "-3", "-T1", "-q", "-c", str(path)], check=True, capture_output=True).stdout
    return len(out)


def rsync_bytes(new: Path, old: Path, work: Path) -> int:
    """Bytes rsync -z moves to update ``old`` into ``new`` (same algorithm as over a network)."""
    dest = work / "rsync-dest"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    shutil.copyfile(old, dest / new.name)
    out = subprocess.run(["rsync", "-z", "--no-whole-file", "--stats", str(new), str(dest) + "/"],
                         check=True, capture_output=True, text=True).stdout
    sent = recv = 0
    for line in out.splitlines():
        if line.startswith("Total bytes sent:"):
            sent = int(line.split(":")[1].replace(",", "").strip())
        if line.startswith("Total bytes received:"):
            recv = int(line.split(":")[1].replace(",", "").strip())
    return sent + recv


def novel_zstd(store_new: Store, kind: str, oid: str, known: set[bytes]) -> tuple[int, int, int]:
    """(zstd -3 bytes of the distinct novel blocks, novel count, non-zero block count)."""
    m = store_new.layer_manifest(oid) if kind == "layer" else store_new.file_manifest(oid)
    from capsule.store.objectio import BlockReader

    reader = BlockReader(store_new, kind, oid)
    seen: set[bytes] = set()
    novel: list[int] = []
    nonzero = 0
    for i, z, h in m.records():
        if z:
            continue
        nonzero += 1
        if h not in known and h not in seen:
            seen.add(h)
            novel.append(i)
    raw = b"".join(reader.read(novel))
    reader.close()
    return len(zstandard.ZstdCompressor(level=3).compress(raw)), len(novel), nonzero


def known_hashes(store: Store) -> set[bytes]:
    out: set[bytes] = set()
    for layer in store.catalogue.layers():
        out.update(h for _i, z, h in store.layer_manifest(layer.id).records() if not z)
    for file in store.catalogue.files():
        out.update(h for _i, z, h in store.file_manifest(file.id).records() if not z)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-kbit", type=int, default=384)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    args = ap.parse_args()
    work = workdir("capsule-hcp-bench-")
    agents: list[AgentProcess] = []
    try:
        src = Store.open(IMAGE_HOME)
        images.build(src, "tiny", "tiny")
        stores = {}
        for name in ("a", "b", "c", "d"):
            stores[name] = Store.open(work / name)
            if name in ("a", "b"):
                images.import_image(src, stores[name], "tiny")
        a, b, c, d = stores["a"], stores["b"], stores["c"], stores["d"]

        # version 2: a guest with a working set in RAM and a written disk
        capsules.create(a, "bench", "tiny", memory="256M")
        lifecycle.start(a, "bench")
        guest(a, "seq 1 2500000 > /tmp/seq; dd if=/dev/urandom of=/tmp/rand bs=1M count=16 2>/dev/null")
        guest(a, "dd if=/tmp/seq of=/dev/vda bs=4096 seek=2000 count=1024 conv=notrunc 2>/dev/null; sync")
        v2 = lifecycle.suspend(a, "bench")
        assert v2.version is not None and v2.memory is not None   # a suspend records both
        agents = [AgentProcess(s.home, work / f"{n}.token") for n, s in (("b", b), ("c", c), ("d", d))]
        agent_b, agent_c, agent_d = agents
        transfer.push(a, v2.version.ref, agent_b.url, agent_b.token)

        # 1. loopback throughput of the memory image
        mem2 = a.file_path(v2.memory.id)
        novel = transfer.push(a, v2.version.ref, agent_c.url, agent_c.token)
        mem_novel = next(o for o in novel.objects if o.role == "memory")
        shutil.copyfile(mem2, work / "unrelated-copy.img")
        d.hash_cache().prime_paths([work / "unrelated-copy.img"])
        d.close()
        agent_d.stop()
        agent_d = AgentProcess(d.home, work / "d.token")
        agents.append(agent_d)
        known = transfer.push(a, v2.version.ref, agent_d.url, agent_d.token)
        mem_known = next(o for o in known.objects if o.role == "memory")
        t_zstd = timed(["zstd", "-3", "-T1", "-q", "-f", "-o", str(work / "m.zst"), str(mem2)])
        t_cp = timed(["cp", "--sparse=always", str(mem2), str(work / "m.copy")])
        raw = mem_novel.raw_bytes
        throughput = {
            "object_raw_bytes": raw,
            "hcp_all_novel_MBps": round(raw / mem_novel.seconds / 1e6, 1),
            "hcp_all_known_MBps": round(raw / mem_known.seconds / 1e6, 1),
            "zstd3_MBps": round(mem2.stat().st_size / t_zstd / 1e6, 1),
            "copy_MBps": round(mem2.stat().st_size / t_cp / 1e6, 1),
            "all_known_fetched_bytes": mem_known.fetched_bytes,
        }

        # version 3: a little more work
        lifecycle.start(a, "bench")
        guest(a, "seq 3000000 3200000 > /tmp/seq2; rm /tmp/rand; "
                 "dd if=/tmp/seq2 of=/dev/vda bs=4096 seek=6000 count=128 conv=notrunc 2>/dev/null; sync")
        v3 = lifecycle.suspend(a, "bench")
        assert v3.version is not None
        b_known = known_hashes(b)

        # 2. push v3 over the shaped link: agent B inside namespace B, the client inside namespace A
        for ag in agents:
            ag.stop()
        agents = []
        with SlowLink(rate_kbit=args.rate_kbit, rtt_ms=args.rtt_ms) as link:
            port = 7070
            url, pin = link.agent_b(b.home, work / "b.token", port)
            env = dict(os.environ, CAPSULE_TOKEN=(work / "b.token").read_text().strip(), PYTHONPATH=str(ROOT))
            t = time.monotonic()
            r = link.exec_a([*CAPSULE, "--home", str(a.home), "push", v3.version.ref, "--to", url,
                             "--fingerprint", pin, "--json"],
                            capture_output=True, text=True, env=env)
            link_seconds = time.monotonic() - t
            if r.returncode != 0:
                raise SystemExit(f"push over the shaped link failed: {r.stderr}")
            report = json.loads(r.stdout)
            # the same push, the memory image's manifest on its own (--no-like), to C (it holds v2 as B did)
            url_c, pin_c = link.agent_b(c.home, work / "c.token", port + 1)
            env_c = dict(env, CAPSULE_TOKEN=(work / "c.token").read_text().strip())
            r = link.exec_a([*CAPSULE, "--home", str(a.home), "push", v3.version.ref, "--to", url_c,
                             "--fingerprint", pin_c, "--json", "--no-like"], capture_output=True, text=True, env=env_c)
            if r.returncode != 0:
                raise SystemExit(f"push --no-like over the shaped link failed: {r.stderr}")
            plain = json.loads(r.stdout)
            # the peer: one plain HTTP download of as many bytes over the same link and proxy
            blob_dir = work / "blob"
            blob_dir.mkdir()
            (blob_dir / "blob").write_bytes(os.urandom(report["wire_bytes"]))
            link.spawn_b([sys.executable, "-m", "http.server", "8000", "--bind", link.ip_b, "--directory",
                          str(blob_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            link.wait_port_b(8000)
            blob_url = link.url_b(8000) + "/blob"
            getter = ("import sys,time,urllib.request; t=time.monotonic(); "
                      f"n=len(urllib.request.urlopen('{blob_url}').read()); print(time.monotonic()-t)")
            bulk_seconds = float(link.exec_a([sys.executable, "-c", getter], capture_output=True, text=True,
                                             check=True).stdout)
        rate_Bps = args.rate_kbit * 1000 / 8
        rows = []
        objects = []
        for o in report["objects"]:
            kind, oid = o["kind"], o["id"]
            path = a.layer_path(oid) if kind == "layer" else a.file_path(oid)
            prev = (a.layer_path(v2.layers[0].id) if kind == "layer" and v2.layers
                    else a.file_path(v2.memory.id))
            zn, n_novel, nonzero = novel_zstd(a, kind, oid, b_known)
            goal = 1.02 * zn + 32 * nonzero
            entry = {"object": f"{o['role']} {oid[:12]}", "raw_bytes": o["raw_bytes"],
                     "hcp_wire_bytes": o["wire_bytes"],
                     "zstd3_object_bytes": zstd_size(path), "rsync_z_vs_previous_bytes": rsync_bytes(path, prev, work),
                     "zstd3_novel_blocks_bytes": zn, "novel_blocks": n_novel, "nonzero_blocks": nonzero,
                     "goal_bytes": int(goal), "hcp_vs_goal": round(o["wire_bytes"] / goal, 3) if goal else None,
                     "seconds": round(o["seconds"], 2), "commit_seconds": round(o["commit_seconds"], 2),
                     "like": o.get("like"),
                     "hcp_wire_bytes_no_like": next((p["wire_bytes"] for p in plain["objects"] if p["id"] == oid),
                                                    None)}
            objects.append(entry)
            rows.append([entry["object"], entry["raw_bytes"], entry["hcp_wire_bytes"],
                         entry["hcp_wire_bytes_no_like"], entry["zstd3_object_bytes"],
                         entry["rsync_z_vs_previous_bytes"], entry["zstd3_novel_blocks_bytes"],
                         entry["hcp_vs_goal"]])
        total_wire = report["wire_bytes"]
        transfer_seconds = report["seconds"]
        result = {
            "loopback_memory_image": throughput,
            "link": {"rate_kbit": args.rate_kbit, "rtt_ms": args.rtt_ms},
            "push_v3": {"objects": objects, "total_wire_bytes": total_wire,
                        "transfer_seconds": round(transfer_seconds, 2),
                        "command_seconds_incl_startup": round(link_seconds, 2),
                        "time_vs_bytes_over_rate": round(transfer_seconds / (total_wire / rate_Bps), 3),
                        "bulk_http_same_bytes_seconds": round(bulk_seconds, 2),
                        "time_vs_bulk_http": round(transfer_seconds / bulk_seconds, 3)},
            "goals": {"wire": "hcp_vs_goal <= 1.0", "time": "time_vs_bytes_over_rate <= 1.05"},
        }
        path = write_result("hcp", result)
        table("HCP loopback, memory image", ["all-novel MB/s", "all-known MB/s", "zstd -3 MB/s", "copy MB/s"],
              [[throughput["hcp_all_novel_MBps"], throughput["hcp_all_known_MBps"], throughput["zstd3_MBps"],
                throughput["copy_MBps"]]])
        table(f"push of the next version over {args.rate_kbit} kbit/s, {args.rtt_ms:.0f} ms RTT (bytes)",
              ["object", "raw", "HCP wire", "--no-like", "zstd -3", "rsync -z vs prev", "zstd novel", "HCP/goal"],
              rows)
        print(f"total {total_wire} B on the wire in {transfer_seconds:.1f}s ({link_seconds:.1f}s with start-up) = "
              f"{result['push_v3']['time_vs_bytes_over_rate']:.2f} x bytes/rate; a plain HTTP download of as many "
              f"bytes took {bulk_seconds:.1f}s ({result['push_v3']['time_vs_bulk_http']:.2f} x)  → {path}")
    finally:
        for ag in agents:
            ag.stop()
        from testkit.images import destroy_domains

        for s in (Store.open(work / n) for n in ("a", "b", "c", "d") if (work / n).exists()):
            destroy_domains(s)
            s.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
