"""What a TCP client sees when its server pod moves: two Debian capsules on the host's pod network, a client in
a network namespace this run attaches to the pod bridge, a numbered line every 0.2 s on one connection. The
pod is migrated to the other capsule (and back, ``--moves``); the peer in the same run: the same pod
checkpointed and restored in its own capsule. For each: the longest wait for a reply the client saw, the
operation's own time, and the ratio gap / peer gap (under TCG when the host has no KVM: the accel is in the
result).

    .venv/bin/python bench/pod_network_bench.py [--moves 2] [--memory 512M]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import image_stores, table, temp_workdir, write_result  # noqa: E402
from capsule import capsules, lifecycle  # noqa: E402
from capsule.pod import ops  # noqa: E402
from capsule.runtime import podnet  # noqa: E402

SERVER = ("import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 7000))\ns.listen()\nc, _ = s.accept()\n"
          "for n, line in enumerate(c.makefile('rb'), 1):\n    c.sendall(b'%d %s' % (n, line))\n")
CLIENT = """
import os, socket, sys, time
for _ in range(120):  # the pod's server may not listen yet
    try:
        s = socket.create_connection((sys.argv[1], 7000), timeout=600)
        break
    except ConnectionRefusedError:
        time.sleep(0.5)
f, log, i = s.makefile("rb"), open(sys.argv[2], "a", buffering=1), 0
while not os.path.exists(sys.argv[3]):
    i += 1
    s.sendall(b"%d\\n" % i)
    if f.readline() != b"%d %d\\n" % (i, i):
        sys.exit(f"line {i}: wrong reply")
    log.write(f"{i} {time.time():.3f}\\n")
    time.sleep(0.2)
"""


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


def _times(log: Path) -> list[float]:
    return [float(ln.split()[1]) for ln in log.read_text().splitlines()] if log.exists() else []


def _gap_over(log: Path, op) -> tuple[float, dict]:
    """Run ``op`` under the client; the longest wait between replies from just before it to 10 replies after."""
    start = len(_times(log))
    result = op()
    end = len(_times(log))
    deadline = time.monotonic() + 300
    while len(_times(log)) < end + 10:
        if time.monotonic() > deadline:
            raise SystemExit("the client stopped talking")
        time.sleep(0.5)
    times = _times(log)[max(start - 1, 0):]
    return max(b - a for a, b in zip(times, times[1:], strict=False)), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moves", type=int, default=2, help="migrations (alternating between the two capsules)")
    ap.add_argument("--memory", default="512M", help="each capsule's memory")
    args = ap.parse_args()
    ns, veth = f"capsule-podbench-{os.getpid()}", f"cpb{os.getpid() % 100000}"
    with temp_workdir("pod-network-bench-") as tmp:
        (store,) = image_stores("debian", Path(tmp) / "store")
        for name in ("ba", "bb"):
            capsules.create(store, name, "debian", memory=args.memory, pod_network=True)
            started = lifecycle.start(store, name, timeout=400)
        podnet.ensure_bridge()
        _ip("netns", "add", ns)
        client = None
        stop, log = Path(tmp) / "stop", Path(tmp) / "client.log"
        try:
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", podnet.BRIDGE, "up")
            for argv in (("link", "set", "lo", "up"), ("addr", "add", "198.18.0.250/24", "dev", "eth0"),
                         ("link", "set", "eth0", "up")):
                _ip("netns", "exec", ns, "ip", *argv)
            made = ops.create(store, "ba", "srv", ["python3", "-c", SERVER])
            client = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT,
                                       made["ip"].split("/")[0], str(log), str(stop)])
            while len(_times(log)) < 10:
                if client.poll() is not None:
                    raise SystemExit(f"the client failed (exit {client.returncode})")
                time.sleep(0.5)
            rows, out = [], []

            def in_place() -> dict:
                ck = ops.checkpoint(store, "ba/srv")
                back = ops.restore(store, ck.image, "ba")
                return {"seconds": round(ck.seconds + back["seconds"], 3)}

            peer_gap, peer = _gap_over(log, in_place)
            out.append({"op": "checkpoint + restore in ba", "gap_s": round(peer_gap, 3), "op_s": peer["seconds"]})
            where = "ba"
            for _ in range(args.moves):
                to = "bb" if where == "ba" else "ba"
                gap, moved = _gap_over(log, lambda w=where, t=to: ops.migrate(store, f"{w}/srv", t))
                out.append({"op": f"migrate {where} → {to}", "gap_s": round(gap, 3), "op_s": moved["seconds"]})
                where = to
            for r in out:
                r["gap_vs_in_place"] = round(r["gap_s"] / peer_gap, 3)
                rows.append([r["op"], r["op_s"], r["gap_s"], r["gap_vs_in_place"]])
            rounds = len(_times(log))
        finally:
            stop.touch()
            if client is not None:
                client.wait(timeout=60)
            subprocess.run(["ip", "link", "del", veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            for name in ("ba", "bb"):
                lifecycle.stop(store, name, force=True, discard=True)
        if client.returncode != 0:
            raise SystemExit(f"the client failed (exit {client.returncode})")
        table(f"a TCP client across pod moves on the pod network ({started.accel}); {rounds} round trips on one "
              f"connection; peer: checkpoint + restore in place", ["operation", "op s", "client gap s",
                                                                  "gap / in place"], rows)
        path = write_result("pod_network", {"accel": started.accel, "capsule_memory": args.memory, "ops": out,
                                            "round_trips": rounds})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
