"""Issue 13's pod figures, one run, under TCG when the host has no KVM (the accel is in the result): for pods
of ``--procs`` processes holding ``--sizes`` MiB of memory in all (random bytes, shared out among the
processes: the worst case for an image), in Debian capsules

* checkpoint to the capsule's disk (CRIU's dump and the image's archive, in the guest, the pod left running)
  and restart from it (the pod killed, CRIU's restore from that image);
* migration to another capsule on the same host (``capsule pod migrate --to``): time and image bytes;
* migration to a capsule on another host (two stores, the other's agent) over loopback ("LAN") and, for the
  pods of ``--slow-sizes`` MiB only, over a 384 kbit/s, 20 ms link (network namespaces, ``tbf``; the
  CLI runs in A, the other agent in B): time and bytes on the wire, against the zstd -3 size of the
  pod's memory (the issue's goal: at most that);
* the same pod moved back to this host (its store holds the first image): the wire bytes of that second move
  (the goal: fewer, as its unchanged blocks are found there).

``--content`` picks the pods' memory: random (the worst case, the default) or mixed (random, zero and
text-like pages, as a heap holds).

Zap's anchors: ~963 ms checkpoint and ~811 ms restart of a desktop pod (2002 hardware); Laadan–Nieh < 600 ms.

    .venv/bin/python -m bench.pods_matrix [--procs 1,10,50] [--sizes 10,50,200] [--slow-sizes 10] [--slow-procs 1]
        [--content random|mixed]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import zstandard

from bench.common import table, temp_workdir, write_result
from bench.pods_bench import wait_ready
from capsule import capsules, images, lifecycle
from capsule.agent.launch import AgentProcess
from capsule.errors import Error
from capsule.pod import ops, remote
from capsule.pod.relay import Relay
from capsule.store import Store
from testkit.images import IMAGE_HOME

ROOT = Path(__file__).resolve().parent.parent
# N processes (the first and N - 1 children) each holding its share of memory; ready once all are.
# content "random": os.urandom (incompressible, the worst case); "mixed": per 4 KiB page, one in four random,
# one in four zero, the rest text-like (a word list repeated with the page's number): roughly what a
# process's heap holds, compressible about 3:1
HOLD = """
import os, time
n, mib, content = {procs}, {mib}, {content!r}
share = max(1, (mib << 20) // n)
def fill(size):
    if content == "random":
        return os.urandom(size)
    out = bytearray()
    words = b"pod capsule page heap string object list dict value key name time "
    for k in range(0, size, 4096):
        kind = k // 4096 % 4
        if kind == 0:
            out += os.urandom(4096)
        elif kind == 1:
            out += bytes(4096)
        else:
            out += ((b"%d " % (k + os.getpid())) + words * 64)[:4096]
    return bytes(out[:size])
for i in range(n - 1):
    if os.fork() == 0:
        b = fill(share)
        open(f"/tmp/ready.{{i}}", "w").write("1")
        time.sleep(1e9)
b = fill(share)
while len([f for f in os.listdir("/tmp") if f.startswith("ready.")]) < n - 1:
    time.sleep(0.2)
open("/tmp/ready", "w").write("1")
time.sleep(1e9)
"""


def _zstd_of_memory(procs: int, mib: int, content: str) -> int:
    """zstd -3 of the memory the pod holds (the same fill, run here)."""
    ns: dict = {}
    src = HOLD.format(procs=procs, mib=mib, content=content)
    exec(src[:src.index("for i in range(n - 1)")], ns)
    share = max(1, (mib << 20) // procs)
    return sum(len(zstandard.ZstdCompressor(level=3).compress(ns["fill"](share))) for _ in range(procs))


def _case(a: Store, b: Store, agents: tuple[AgentProcess, AgentProcess], procs: int, mib: int,
          content: str) -> dict:
    agent_a, agent_b = agents
    pod = f"p{procs}x{mib}"
    hold = ["python3", "-c", HOLD.format(procs=procs, mib=mib, content=content)]
    ops.create(a, "pa", pod, hold)
    wait_ready(a, f"pa/{pod}", 600.0)
    relay = Relay(a, "pa")
    # to the capsule's disk and back: CRIU in the guest only
    dumped = relay.call("checkpoint", pod, "--leave-running", timeout=900)
    ops.kill(a, f"pa/{pod}")
    t0 = time.monotonic()
    relay.call("restore", dumped["path"], timeout=900)
    restart_s = time.monotonic() - t0
    relay.sh(f"rm -f {dumped['path']}")
    # to the other capsule of this host, then to the other host's capsule over loopback
    same = ops.migrate(a, f"pa/{pod}", "pb")
    lan = remote.migrate(a, f"pb/{pod}", "hb", agent_b.url, agent_b.token)
    # and back again: this host's store still holds the first image, so only what changed need travel
    back = remote.migrate(b, f"hb/{pod}", "pb", agent_a.url, agent_a.token)
    row = {"procs": procs, "mib": mib, "content": content, "image_bytes": dumped["size"],
           "zstd_memory_bytes": _zstd_of_memory(procs, mib, content),
           "checkpoint_to_disk_s": dumped["seconds"], "dump_s": dumped["dump_seconds"],
           "restart_from_disk_s": round(restart_s, 3), "migrate_same_host_s": same["seconds"],
           "migrate_lan_s": lan["seconds"], "lan_wire_bytes": lan["wire_bytes"],
           "move_back_s": back["seconds"], "move_back_wire_bytes": back["wire_bytes"],
           "move_back_found_there_bytes": back["found_there_bytes"]}
    ops.kill(a, f"pb/{pod}")
    return row


def _slow(a: Store, b: Store, row: dict, slow: dict, timeout: float) -> None:
    """The same pod made again and moved to the other host over the slow link (the CLI in A's namespace);
    a failure or a timeout is recorded in the row, not raised (the pod is restored in A then, and killed)."""
    pod = f"p{row['procs']}x{row['mib']}"
    ops.create(a, "pa", pod, ["python3", "-c", HOLD.format(procs=row["procs"], mib=row["mib"], content=row["content"])])
    wait_ready(a, f"pa/{pod}", 600.0)
    t0 = time.monotonic()
    before = slow["link"].wire_bytes()
    try:
        out = slow["link"].exec_a([sys.executable, "-m", "capsule.cli.main", "--home", str(a.home), "--json", "pod",
                                   "migrate", f"pa/{pod}", "--to", "hb", "--on", slow["url"], "--token-file",
                                   str(slow["token_file"]), "--fingerprint", slow["fingerprint"]],
                                  capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        failed = out.stderr.strip().splitlines()[-1:] if out.returncode != 0 else []
    except subprocess.TimeoutExpired:
        out, failed = None, [f"not done in {timeout:.0f} s"]
    row |= {"migrate_384k_s": round(time.monotonic() - t0, 3), "slow_link_bytes": slow["link"].wire_bytes() - before,
            "slow_retries_logged": sum("trying again" in ln for ln in (out.stderr if out else "").splitlines())}
    if failed:
        row["slow_error"] = failed[0]
        for s, ref in ((a, f"pa/{pod}"), (b, f"hb/{pod}")):
            with contextlib.suppress(Error):  # wherever it was left
                ops.kill(s, ref)
        return
    row["slow_wire_bytes"] = json.loads(out.stdout)["wire_bytes"]
    ops.kill(b, f"hb/{pod}")


def _row(r: dict) -> list:
    if "error" in r:
        return [r["procs"], r["mib"], f"failed: {r['error'][:60]}", *["-"] * 8]
    z = r["zstd_memory_bytes"]
    return [r["procs"], r["mib"], f"{r['image_bytes'] / 2**20:.1f}", r["checkpoint_to_disk_s"],
            r["restart_from_disk_s"], r["migrate_same_host_s"], r["migrate_lan_s"], f"{r['lan_wire_bytes'] / z:.2f}",
            f"{r['move_back_wire_bytes'] / z:.3f}",
            r.get("migrate_384k_s", "-") if "slow_error" not in r else "failed",
            f"{r['slow_link_bytes'] / r['slow_wire_bytes']:.2f}" if "slow_wire_bytes" in r else "-"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default="1,10,50")
    ap.add_argument("--sizes", default="10,50,200", help="MiB of memory in each pod, comma-separated")
    ap.add_argument("--slow-sizes", default="10", help="sizes also moved over 384 kbit/s ('' for none)")
    ap.add_argument("--slow-procs", default="1", help="process counts also moved over 384 kbit/s")
    ap.add_argument("--slow-timeout", type=float, default=1200.0, help="seconds a slow move may take")
    ap.add_argument("--content", choices=("random", "mixed"), default="random",
                    help="the pods' memory: random (worst case) or mixed (random, zero and text-like pages)")
    ap.add_argument("--memory", default="1G", help="each capsule's memory")
    ap.add_argument("--images", default=str(IMAGE_HOME))
    args = ap.parse_args()
    procs = [int(x) for x in args.procs.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    slow_sizes = {int(x) for x in args.slow_sizes.split(",") if x}
    slow_procs = {int(x) for x in args.slow_procs.split(",") if x}
    from testkit.netlink import DSL, SlowLink

    with temp_workdir("pods-matrix-") as tmp:
        work = Path(tmp)
        src = Store.open(Path(args.images))
        a, b = Store.open(work / "a"), Store.open(work / "b")
        for s in (a, b):
            images.import_image(src, s, "debian")
        for s, name in ((a, "pa"), (a, "pb"), (b, "hb")):
            capsules.create(s, name, "debian", memory=args.memory)
        accel = ""
        rows: list[list] = []
        out: list[dict] = []
        with AgentProcess(a.home, work / "a.token") as agent_a, AgentProcess(b.home, work / "b.token") as agent_b, \
                SlowLink(**DSL) as link:
            # off loopback the agent speaks TLS (its own host key, made on this first start); the CLI pins it
            slow_url, pin = link.agent_b(b.home, work / "b.token")
            slow = {"link": link, "url": slow_url, "token_file": work / "b.token", "fingerprint": pin}
            try:
                for s, name in ((a, "pa"), (a, "pb"), (b, "hb")):
                    accel = lifecycle.start(s, name, timeout=600).accel
                for n in procs:
                    for mib in sizes:
                        try:
                            out.append(_case(a, b, (agent_a, agent_b), n, mib, args.content))
                        except Error as exc:  # recorded; the pod killed wherever it was left, the run goes on
                            out.append({"procs": n, "mib": mib, "content": args.content, "error": str(exc)})
                            for s, ref in ((a, f"pa/p{n}x{mib}"), (a, f"pb/p{n}x{mib}"), (b, f"hb/p{n}x{mib}")):
                                with contextlib.suppress(Error):
                                    ops.kill(s, ref)
                        print(json.dumps(out[-1]), flush=True)
                for r in out:  # the slow moves last: they take longest
                    if r["mib"] in slow_sizes and r["procs"] in slow_procs and "error" not in r:
                        _slow(a, b, r, slow, args.slow_timeout)
                        print(json.dumps(r), flush=True)
                rows = [_row(r) for r in out]
            finally:  # the slow agent stops with the link
                for s, name in ((a, "pa"), (a, "pb"), (b, "hb")):
                    lifecycle.stop(s, name, force=True, discard=True)
        table(f"pods ({accel}, {args.content} memory): checkpoint/restart in the capsule, migration to a capsule "
              "here, on another host (loopback), back again, and over 384 kbit/s",
              ["procs", "MiB", "image MiB", "ckpt→disk s", "restart s", "same host s", "LAN s",
               "LAN wire / zstd(mem)", "back wire / zstd(mem)", "384k s", "384k link / wire"], rows)
        path = write_result("pods_matrix", {"accel": accel, "capsule_memory": args.memory, "content": args.content,
                                            "cases": out,
                                            "anchors": {"zap_checkpoint_s": 0.963, "zap_restart_s": 0.811,
                                                        "laadan_nieh_s": 0.6}})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
