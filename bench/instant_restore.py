"""B5's instant restore: a version booted straight from the S3 repository (`capsule start NAME@V --from s3://…`)
against the same version demand-paged from a peer's agent (`capsule start NAME@V --from http://…`), each on a
host that never held the capsule, on the LAN and over a paced link.

Store A holds capsule ``deb`` (the Debian image, or ``--image``), pushed to a repository on a SeaweedFS cluster on
loopback; A's agent serves the peer case. Each case starts the capsule in a new, empty store (no image either) with
the CLI, timed from its start until it returns at the guest's boot marker; the disk server's counters give the
bytes the guest read and those that came for it. ``--rate-kbit`` (default 20000) puts a pacing, delaying proxy
(testkit/delayproxy.py: each direction paced, ``--rtt-ms`` round trip) in front of both the S3 gateway and the
agent for the second pass; the first is plain loopback. Result: `bench/results/instant_restore.json`.

    .venv/bin/python bench/instant_restore.py [--image debian] [--rate-kbit 20000 --rtt-ms 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import image_stores, table, workdir, write_result  # noqa: E402
from bench.repo_vs_restic import PASS  # noqa: E402
from capsule import capsules  # noqa: E402
from capsule.agent.launch import AgentProcess  # noqa: E402
from capsule.lifecycle import demand  # noqa: E402
from capsule.repo.push import push  # noqa: E402
from capsule.repo.repository import Repository  # noqa: E402
from capsule.repo.s3 import Credentials, S3Client, parse_url  # noqa: E402
from capsule.runtime.connection import lookup_domain  # noqa: E402
from capsule.store import Store  # noqa: E402
from testkit.seaweedfs import SeaweedCluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAME = "deb"
GOAL = 1.2          # the repository's time to the marker at most this × the peer's
DISK = ("guest_bytes", "source_bytes", "wire_bytes")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def paced(to_port: int, rate_kbit: int, rtt_ms: float) -> Iterator[int]:
    """A delaying, pacing proxy on loopback in front of ``to_port``; its port (``to_port`` itself at rate 0)."""
    if not rate_kbit:
        yield to_port
        return
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "testkit" / "delayproxy.py"), "--listen",
                             f"127.0.0.1:{port}", "--to", f"127.0.0.1:{to_port}", "--delay-ms", str(rtt_ms / 2),
                             "--rate-kbit", str(rate_kbit)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the pacing proxy did not listen") from None
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def start_in_new_store(home: Path, source: str, env: dict[str, str], *extra: str) -> dict[str, Any]:
    """`capsule start deb@1 --from SOURCE` in the new store ``home``: seconds to the boot marker, the disk server's
    counters, the report."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "capsule.cli.main", "--home", str(home), "--json", "start",
                           f"{NAME}@1", "--from", source, "--timeout", "900", *extra], capture_output=True,
                          text=True, env=env, timeout=1200)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"start --from {source}: {proc.stderr[-2000:]}")
    time.sleep(1.2)                                   # the disk server writes its counters each second
    store = Store.open(home)
    try:
        inst = store.catalogue.instance(NAME)
        assert inst is not None
        stats = json.loads((demand.shadow_dir(store) / f"{Path(inst.dir).name}-disk0.stats.json").read_text())
        dom = lookup_domain(store.domain_name(NAME))
        if dom is not None:
            dom.destroy()
    finally:
        store.close()
    return {"seconds_to_marker": round(seconds, 2), **{k: stats.get(k) for k in DISK},
            "link_over_read": round(stats["wire_bytes"] / stats["guest_bytes"], 3) if stats.get("guest_bytes")
            else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", default="debian", help="the capsule's image (default debian)")
    ap.add_argument("--rate-kbit", type=int, default=20000, help="the paced pass's rate (0: LAN only)")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    args = ap.parse_args()
    work = workdir("capsule-b5i-")
    cluster = SeaweedCluster(work / "seaweedfs")
    rows: list[dict[str, Any]] = []
    agent = None
    try:
        cluster.start()
        [a] = image_stores(args.image, work / "a")
        capsules.create(a, NAME, args.image, memory="512M")
        client = S3Client(parse_url(cluster.url("instant", "lab")), Credentials(cluster.access_key,
                                                                                 cluster.secret_key))
        pushed = push(a, f"{NAME}@1", Repository.init(client, PASS))
        client.close()
        agent = AgentProcess(a.home, work / "a.token")
        token = work / "a.token"
        s3_port, agent_port = int(cluster.endpoint.rsplit(":", 1)[1]), int(agent.url.rsplit(":", 1)[1])
        env = {**os.environ, **cluster.env(), "CAPSULE_REPO_PASSPHRASE": PASS.decode(), "PYTHONPATH": str(ROOT)}
        for link, rate in (("LAN", 0), (f"{args.rate_kbit} kbit/s, {args.rtt_ms:g} ms", args.rate_kbit)):
            if link != "LAN" and not rate:
                continue
            with paced(s3_port, rate, args.rtt_ms) as sp, paced(agent_port, rate, args.rtt_ms) as ap_:
                for case in ("repository", "peer"):
                    home = work / f"{case}-{rate}"
                    source = (f"s3+http://127.0.0.1:{sp}/instant/lab" if case == "repository"
                              else f"http://127.0.0.1:{ap_}")
                    extra = () if case == "repository" else ("--token-file", str(token))
                    got = start_in_new_store(home, source, env, *extra)
                    rows.append({"link": link, "case": case, **got})
                    print(f"{link}, {case}: {got}", flush=True)
    finally:
        if agent is not None:
            agent.stop()
        cluster.remove()
        shutil.rmtree(work, ignore_errors=True)

    ratios = {}
    for link in dict.fromkeys(r["link"] for r in rows):
        t = {r["case"]: r["seconds_to_marker"] for r in rows if r["link"] == link}
        ratios[link] = round(t["repository"] / t["peer"], 3)
    result = {"image": args.image, "pushed_bytes": pushed.uploaded_bytes, "rows": rows,
              "repository_over_peer": ratios, "goal": GOAL, "met": all(v <= GOAL for v in ratios.values())}
    path = write_result("instant_restore", result)
    table(f"{args.image} capsule started on a host that never held it: seconds to the boot marker",
          ["link", "case", "seconds", "guest read MB", "came MB", "link ÷ read"],
          [[r["link"], r["case"], f"{r['seconds_to_marker']:.1f}", f"{(r['guest_bytes'] or 0) / 1e6:.1f}",
            f"{(r['wire_bytes'] or 0) / 1e6:.1f}", str(r["link_over_read"])] for r in rows])
    print(f"repository ÷ peer: {ratios} (goal ≤ {GOAL}); → {path}")


if __name__ == "__main__":
    main()
