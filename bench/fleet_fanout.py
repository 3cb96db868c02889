"""One sender against fan-out, for a rollout to N = 4, 8, 16 hosts on shaped links, in the same run.

Every host (and the origin, the administrator's store) sits in its own network namespace with a link of
``--rate-kbit`` in each direction to one switch (bench/fleetnet.py). Each host has a store holding the
tiny image and an agent; each measured rollout pushes a fresh version whose new layer is ``--layer-mib``
of random data (what no host has yet). Modes:

- ``one sender``: only the origin sends (``--no-fanout``), to all N hosts at once (``--parallel N``);
- ``fan-out K``: every host that has the version passes it on, each sender to K hosts at a time.

Run as root (namespaces): ``python -m bench.fleet_fanout [--sizes 4,8,16] [--rate-kbit 20000]``.
Writes bench/results/fleet_fanout.json."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import table, temp_workdir, write_result
from bench.fleetnet import Star
from testkit.images import IMAGE_HOME

ROOT = Path(__file__).resolve().parent.parent
PORT = 7070
MiB = 1 << 20


def _inner(spec: dict) -> dict:
    """Inside the origin's namespace: make the hosts fleet members (once), roll the version out."""
    from capsule.agent.serve import host_fingerprint
    from capsule.fleet import members
    from capsule.fleet import push as pushing
    from capsule.store import Store

    store = Store.open(Path(spec["origin"]))
    known = {m.name for m in members.members(store)}
    for h in spec["hosts"]:
        deadline = time.monotonic() + 180
        while h["name"] not in known:
            try:
                # off loopback the agent speaks TLS with the host key it made on its first start: pin it
                pin = host_fingerprint(Path(h["home"]))
                if pin is None:
                    raise RuntimeError("no host key yet")
                members.add(store, h["name"], h["url"], Path(h["token_file"]).read_text().strip(), fingerprint=pin)
                known.add(h["name"])
            except Exception as exc:  # noqa: BLE001 - the agent may still be starting
                if time.monotonic() > deadline:
                    raise SystemExit(f"agent {h['name']} at {h['url']} did not answer: {exc}") from exc
                time.sleep(0.5)
    opts = pushing.PushOptions(hosts=[h["name"] for h in spec["hosts"]], parallel=spec["parallel"],
                               fanout=spec["fanout"], timeout=10.0)
    report = pushing.push(store, spec["ref"], opts)
    return report.as_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4,8,16")
    ap.add_argument("--rate-kbit", type=int, default=20_000)
    ap.add_argument("--layer-mib", type=int, default=4)
    ap.add_argument("--fanout-parallel", default="1,2")
    ap.add_argument("--images", default=str(IMAGE_HOME))
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        sys.stdout.write(json.dumps(_inner(json.loads(args.inner))) + "\n")
        return

    from capsule import capsules, images
    from capsule.agent.launch import serve_command
    from capsule.store import Store
    from testkit.fleetkit import new_version

    sizes = [int(x) for x in args.sizes.split(",")]
    fan_ks = [int(x) for x in args.fanout_parallel.split(",")]
    n = max(sizes)
    source = Store.open(Path(args.images))
    rows, runs = [], []
    with temp_workdir("fleet-bench-") as tmp, Star(n + 1, args.rate_kbit) as net:
        base = Path(tmp)
        origin = Store.open(base / "origin")
        images.import_image(source, origin, "tiny")
        capsules.create(origin, "app", "tiny", memory="256M")
        hosts = []
        for i in range(1, n + 1):
            home = base / f"h{i:02d}"
            images.import_image(source, Store.open(home), "tiny")
            token_file = base / f"h{i:02d}.token"
            net.spawn(i, serve_command(home, f"{net.ip(i)}:{PORT}", token_file),
                      stdout=subprocess.DEVNULL, stderr=(base / f"h{i:02d}.log").open("ab"))
            hosts.append({"name": f"h{i:02d}", "url": f"https://{net.ip(i)}:{PORT}", "token_file": str(token_file),
                          "home": str(home)})
        modes = [("one sender", False, None)] + [(f"fan-out {k}", True, k) for k in fan_ks]
        seed = 1000
        for size in sizes:
            for label, fanout, k in modes:
                seed += 1
                v = new_version(origin, "app", args.layer_mib * MiB, seed=seed, base_version=1)
                spec = {"origin": str(origin.home), "hosts": hosts[:size], "ref": v.ref, "fanout": fanout,
                        "parallel": size if k is None else k}
                t0 = time.monotonic()
                out = net.run(0, [sys.executable, "-m", "bench.fleet_fanout", "--inner", json.dumps(spec)],
                              capture_output=True, text=True, cwd=ROOT, check=False,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
                if out.returncode != 0:
                    raise SystemExit(f"rollout failed ({label}, N={size}): {out.stderr[-3000:]}")
                report = json.loads(out.stdout.strip().splitlines()[-1])
                wall = time.monotonic() - t0
                done = [h for h in report["hosts"] if h["state"] == "done"]
                assert report["completed"] and len(done) == size, report
                from_origin = sum(h["bytes"] for h in done if h["source"] == "origin")
                total = sum(h["bytes"] for h in done)
                runs.append({"hosts": size, "mode": label, "parallel": spec["parallel"], "fanout": fanout,
                             "seconds": report["seconds"], "wall_seconds": round(wall, 2),
                             "origin_wire_bytes": from_origin, "total_wire_bytes": total,
                             "sent_by_origin": sum(1 for h in done if h["source"] == "origin"),
                             "tree": {h["host"]: h["source"] for h in done}})
                rows.append([size, label, f"{report['seconds']:.1f}", sum(1 for h in done if h["source"] == "origin"),
                             f"{from_origin / MiB:.1f}", f"{total / MiB:.1f}"])
                print(f"N={size} {label}: {report['seconds']:.1f}s", flush=True)
    table(f"rollout of a {args.layer_mib} MiB layer, links {args.rate_kbit} kbit/s each way",
          ["hosts", "mode", "seconds", "sent by origin", "origin MiB", "total MiB"], rows)
    path = write_result("fleet_fanout", {
        "setup": {"rate_kbit": args.rate_kbit, "layer_mib": args.layer_mib, "shaping": "tbf on both ends of each "
                  "host's veth to one bridge (its own network namespace per host and for the origin)",
                  "cpus": os.cpu_count()},
        "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
