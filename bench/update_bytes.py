"""B1, software updates (Collective §5.1, Fig. 5): the bytes an update costs to send, Capsule against peers.

For each case, ``capsule update make`` derives a child of the Debian test image (1 GiB of memory: apt's
files sit in tmpfs), installs real packages from the machine's Debian source inside a real boot (or, for
the "null" update, only boots, runs ``true`` and shuts down), and seals the new layer. Side by side:
- .deb bytes: what apt fetched (measured in its tmpfs before it was dropped);
- HCP wire bytes: the new version pushed to a second store (with its agent) that holds the parent, in the
  codec picked by the link (on loopback: zstd 3 or none), again at a high level (``--high-level``, 19: one
  zstd stream per object) to a third such store, and as one xz stream per object (``capsule push --xz``) to a fourth;
- zstd -3 of the layer: its allocated (non-zero) blocks as one stream;
- rsync -z: the new flattened raw disk against the old one, through a pipe remote shell (bytes sent);
- casync: chunks of the new raw image a store seeded with the old one lacks (zstd chunks, + the index);
  desync is the same scheme in Go and is used when its module can be fetched (it could not: see the JSON);
- OSTree static delta (``--inline``) between commits of the two root trees (debugfs ``rdump``).

Goals (issue 11): HCP ≤ 0.8 × the .deb bytes on installs of 10 MB and more; HCP the smallest of all.

    .venv/bin/python bench/update_bytes.py [--cases jq,nginx-light,null] [--no-ostree] [--replot] [--merge]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import update_peers as peers  # noqa: E402
from bench.backup_accounting import compressed_sizes  # noqa: E402
from bench.common import RESULTS, image_stores, table, workdir, write_result  # noqa: E402
from capsule import capsules, hosts, qemuimg, transfer  # noqa: E402
from capsule.agent.launch import AgentProcess  # noqa: E402
from capsule.store import Store  # noqa: E402
from capsule.store.objectio import BlockReader  # noqa: E402
from capsule.update import make as making  # noqa: E402
from testkit.images import destroy_domains  # noqa: E402

MB = 1e6
BASE = "base"
HOST = "fleet1"
HOST_HIGH = "fleet2"           # a second receiver holding the parent: the push at the high zstd level
HOST_XZ = "fleet3"             # a third: the push with xz
HOST_WHOLE = "fleet4"          # --compare-deltas: the push in the link's codec without deltas
HOST_XZ_WHOLE = "fleet5"       # --compare-deltas: the push with xz without deltas
# case → packages to install (None: the null update); smallest first
CASES: dict[str, list[str] | None] = {
    "null": None,
    "jq": ["jq"],
    "nginx-light": ["nginx-light"],
    "ruby": ["ruby"],
    "python3-numpy": ["python3-numpy"],
    "mousepad": ["mousepad"],
    # installed packages updated to their bookworm-backports versions (bookworm-updates and -security had
    # nothing newer than the image, built from them): systemd, udev, e2fsprogs, iproute2 and their libraries
    "backports": ["systemd/bookworm-backports", "udev/bookworm-backports", "e2fsprogs/bookworm-backports",
                  "iproute2/bookworm-backports"],
    # ~300 packages: a C, Python and Ruby development machine (289 new packages on the test image)
    "mega": ["build-essential", "python3-full", "python3-dev", "git", "cmake", "gdb", "pkg-config", "libssl-dev",
             "libglib2.0-dev", "libxml2-dev", "libsqlite3-dev", "libcurl4-openssl-dev", "ruby-full", "libx11-dev",
             "libcairo2-dev", "libpango1.0-dev"],
}
DEFAULT_CASES = "null,jq,nginx-light,ruby,python3-numpy,mousepad,backports,mega"
PEERS = ["zstd_bytes", "rsync_bytes", "casync_bytes", "ostree_bytes"]
LABELS = {"deb_bytes": ".deb fetched", "hcp_wire_bytes": "HCP wire", "hcp_high_wire_bytes": "HCP wire, high zstd",
          "hcp_xz_wire_bytes": "HCP wire, xz",
          "zstd_bytes": "zstd -3 of layer",
          "rsync_bytes": "rsync -z image", "casync_bytes": "casync new chunks", "ostree_bytes": "OSTree delta"}


def layer_blocks(store: Store, layer_id: str) -> set[int]:
    return {i for i, zero, _h in store.layer_manifest(layer_id).records() if not zero}


def layer_zstd(store: Store, layer_id: str) -> int:
    manifest = store.layer_manifest(layer_id)
    indices = [i for i, zero, _h in manifest.records() if not zero]

    def blocks():
        with BlockReader(store, "layer", layer_id) as reader:
            for k in range(0, len(indices), 256):
                yield b"".join(reader.read(indices[k:k + 256]))
    return compressed_sizes(blocks()).zstd


def _deltas(rep: transfer.TransferReport) -> dict[str, int]:
    """A push's blocks sent as deltas against the parent's (capsule/transfer/similar.py) and their bytes."""
    return {"delta_blocks": sum(o.delta_blocks for o in rep.objects),
            "delta_bytes": sum(o.delta_bytes for o in rep.objects)}


Via = Callable[[AgentProcess], str]


@contextlib.contextmanager
def rated(rate_kbit: int, rtt_ms: float = 20.0) -> Iterator[Via]:
    """What URL reaches an agent over a link of ``rate_kbit`` (0: its own, loopback): a proxy of this
    machine's loopback that paces each direction to that rate and delays it by half ``rtt_ms``
    (testkit/delayproxy.py: no network namespaces, no qdisc on the shared loopback)."""
    proxies: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}

    def via(agent: AgentProcess) -> str:
        if not rate_kbit:
            return agent.url
        if agent.url not in proxies:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            to = agent.url.split("://", 1)[1].rstrip("/")
            proc = subprocess.Popen([sys.executable, str(ROOT / "testkit" / "delayproxy.py"), "--listen",
                                     f"127.0.0.1:{port}", "--to", to, "--delay-ms", str(rtt_ms / 2),
                                     "--rate-kbit", str(rate_kbit)], stdout=subprocess.DEVNULL)
            proxies[agent.url] = (f"http://127.0.0.1:{port}", proc)
            for _ in range(100):
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.1)
        return proxies[agent.url][0]

    try:
        yield via
    finally:
        for _url, proc in proxies.values():
            proc.terminate()
            proc.wait(10)


def run_case(a: Store, case: str, pkgs: list[str] | None, agent: AgentProcess, work: Path, old_raw: Path,
             cas: peers.Casync | None, ost: peers.OSTree | None,
             extra: list[tuple[str, AgentProcess, transfer.Options]], via: Via) -> dict[str, Any]:
    """One case; ``extra``: the other receivers holding the parent, by the key of their push's figures
    ("hcp_high", "hcp_xz"), and the options it is pushed with; ``via``: the URL of a receiver (over the
    shaped link, with ``--rate-kbit``)."""
    name = f"u-{case}"
    print(f"== {case}: update make {BASE} --name {name} " + (f"--install {' '.join(pkgs)}" if pkgs else "--run true"),
          flush=True)
    res = making.make(a, BASE, name=name, install=pkgs or [], run=[] if pkgs else ["true"],
                      say=lambda m: print(f"   {m}", flush=True))
    assert res.version is not None
    (layer,) = res.layers
    row: dict[str, Any] = {"case": case, "packages": pkgs or [], "version": res.version.ref,
                           "make_seconds": round(res.seconds, 1), "deb_bytes": res.apt_debs_bytes,
                           "apt_need_to_get_bytes": res.apt_need_to_get, "layer": layer,
                           "journal_blocks_dropped": res.journal_blocks_dropped}
    rep = transfer.push(a, res.version.ref, via(agent), agent.token)
    row["hcp_wire_bytes"] = rep.wire_bytes
    row["hcp"] = {"raw_bytes": rep.totals()["raw_bytes"], "cache_bytes": rep.totals()["cache_bytes"],
                  "seconds": round(rep.seconds, 1), "codecs": sorted({o.codec for o in rep.objects}),
                  **_deltas(rep), "delta_picks": [{"pick": o.deltas, **o.delta_figures} for o in rep.objects
                                                  if o.deltas]}
    for key, agent_x, opts in extra:
        rep_x = transfer.push(a, res.version.ref, via(agent_x), agent_x.token, opts)
        row[f"{key}_wire_bytes"] = rep_x.wire_bytes
        row[key] = {"zstd_level": opts.level, "xz": opts.xz, "deltas": opts.deltas, "seconds": round(rep_x.seconds, 1),
                    **_deltas(rep_x)}
    row["zstd_bytes"] = layer_zstd(a, layer["id"])
    new_raw = work / "new" / "disk.raw"
    new_raw.parent.mkdir(exist_ok=True)
    qemuimg.flatten_to_raw(a.layer_path(res.version.chains[0][-1]), new_raw)
    row["layer_overhead"] = peers.overhead(new_raw, layer_blocks(a, layer["id"]))
    row["rsync"] = peers.rsync_delta(old_raw, new_raw, work)
    row["rsync_bytes"] = row["rsync"]["sent_bytes"]
    if cas is not None:
        row["casync"] = cas.delta(new_raw, case)
        row["casync_bytes"] = row["casync"]["sent_bytes"]
    if ost is not None:
        root = work / f"root-{case}"
        peers.rdump_root(new_raw, root)
        row["ostree"] = ost.delta(root, case)
        row["ostree_bytes"] = row["ostree"]["sent_bytes"]
        shutil.rmtree(root, ignore_errors=True)
    new_raw.unlink()
    row["goals"] = peers.goals(row, PEERS)
    for key, _agent, _opts in extra:
        row[f"goals_{key.removeprefix('hcp_')}"] = peers.goals(row, PEERS, hcp_key=f"{key}_wire_bytes")
    print("   " + ", ".join(f"{LABELS[k]} {row[k] / MB:.2f} MB" for k in LABELS if k in row), flush=True)
    return row


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in LABELS if any(k in r for r in rows)]
    fig, ax = plt.subplots(figsize=(max(7, 2.2 * len(rows)), 5))
    width = 0.8 / len(keys)
    for j, k in enumerate(keys):
        at = [i for i, r in enumerate(rows) if r.get(k) is not None]   # a peer not measured: no bar
        ax.bar([i - 0.4 + width * (j + 0.5) for i in at], [max(rows[i][k] / MB, 1e-3) for i in at], width,
               label=LABELS[k])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["case"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("MB sent (log)")
    ax.set_title("B1: bytes to move a machine to the updated version")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def show(rows: list[dict[str, Any]]) -> None:
    keys = [k for k in LABELS if any(k in r for r in rows)]
    table("B1: MB per update (10^6 bytes)", ["case", *[LABELS[k] for k in keys], "HCP ≤ 0.8×debs", "HCP smallest"],
          [[r["case"], *[f"{r[k] / MB:.2f}" if k in r else "—" for k in keys],
            {None: "n/a (<10 MB)", True: "yes", False: "no"}[r["goals"]["hcp_le_0.8_debs"]],
            "yes" if r["goals"]["hcp_smallest"] else f"no ({', '.join(r['goals']['peers_not_larger'])})"]
           for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--memory", default="1G", help="the update guest's memory (apt's files sit in tmpfs)")
    ap.add_argument("--no-ostree", action="store_true", help="leave out the OSTree static delta peer")
    ap.add_argument("--no-casync", action="store_true", help="leave out the casync peer")
    ap.add_argument("--high-level", type=int, default=19,
                    help="also push each update at this zstd level to a third store (0: leave it out)")
    ap.add_argument("--no-xz", action="store_true", help="leave out the push with xz (to a fourth store)")
    ap.add_argument("--compare-deltas", action="store_true",
                    help="also push each update without deltas, in the link's codec and with xz (to a fifth and a "
                         "sixth store)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the cases of the JSON result this run does not measure (a rerun of some cases)")
    ap.add_argument("--replot", action="store_true", help="only draw the chart again from the JSON result")
    ap.add_argument("--rate-kbit", type=int, default=0,
                    help="push each update over a link of this rate (kbit/s each way, 20 ms RTT: a pacing proxy "
                         "of the loopback, testkit/delayproxy.py); 0: loopback")
    ap.add_argument("--out", default="update_bytes",
                    help="the name of the JSON result and chart in bench/results (default update_bytes)")
    args = ap.parse_args()
    png = RESULTS / f"{args.out}.png"
    if args.replot:
        data = json.loads((RESULTS / f"{args.out}.json").read_text())
        chart(data["cases"], png)
        show(data["cases"])
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    for tool, flag in (("ostree", args.no_ostree), ("casync", args.no_casync)):
        if not flag and shutil.which(tool) is None:
            sys.exit(f"the {tool} peer needs {tool}: apt-get install {tool} (or give --no-{tool})")
    work = workdir("capsule-b1-")
    agent: AgentProcess | None = None
    extra: list[tuple[str, AgentProcess, transfer.Options]] = []
    stores: list[Store] = []
    kept: list[dict[str, Any]] = []
    if args.merge and (RESULTS / f"{args.out}.json").exists():
        kept = [r for r in json.loads((RESULTS / f"{args.out}.json").read_text())["cases"] if r["case"] not in cases]
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    link = contextlib.ExitStack()
    via = link.enter_context(rated(args.rate_kbit))
    try:
        names = ["a", "b", "c", "d", *(["e", "f"] if args.compare_deltas else [])]
        a, b, c, d, *ef = image_stores("debian", *(work / n for n in names))
        stores += [a, b, c, d, *ef]
        for s in (b, c, d, *ef):
            s.close()
        agent = AgentProcess(b.home, work / "b.token")
        hosts.add(a, HOST, agent.url, agent.token)
        base = capsules.create(a, BASE, "debian", memory=args.memory)
        transfer.push(a, base.ref, agent.url, agent.token)           # the fleet host holds the parent
        wanted = [("hcp_high", HOST_HIGH, c, transfer.Options(level=args.high_level))] if args.high_level else []
        wanted += [] if args.no_xz else [("hcp_xz", HOST_XZ, d, transfer.Options(xz=True))]
        if args.compare_deltas:
            wanted += [("hcp_whole", HOST_WHOLE, ef[0], transfer.Options(deltas=False)),
                       ("hcp_xz_whole", HOST_XZ_WHOLE, ef[1], transfer.Options(xz=True, deltas=False))]
        for key, host, store, opts in wanted:
            agent_x = AgentProcess(store.home, work / f"{host}.token")
            extra.append((key, agent_x, opts))
            hosts.add(a, host, agent_x.url, agent_x.token)
            transfer.push(a, base.ref, agent_x.url, agent_x.token)   # so do the other receivers
        old_raw = work / "old" / "disk.raw"
        old_raw.parent.mkdir()
        qemuimg.flatten_to_raw(a.layer_path(base.chains[0][-1]), old_raw)
        cas = None if args.no_casync else peers.Casync(old_raw, work)
        ost = None
        if not args.no_ostree:
            peers.rdump_root(old_raw, work / "root-old")
            ost = peers.OSTree(work / "root-old", work)
            shutil.rmtree(work / "root-old", ignore_errors=True)
        for case in cases:
            rows.append(run_case(a, case, CASES[case], agent, work, old_raw, cas, ost, extra, via))
            RESULTS.mkdir(exist_ok=True)
            every = _ordered(kept + rows)
            chart(every, png)
            write_result(args.out, _result(every, args, cas, ost, t0))
        show(_ordered(kept + rows))
        print(f"→ {RESULTS / args.out}.json\n→ {png}")
    finally:
        link.close()
        for ag in [agent, *(x[1] for x in extra)]:
            if ag is not None:
                ag.stop()
        for s in stores:
            destroy_domains(s)
        shutil.rmtree(work, ignore_errors=True)


def _ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = list(CASES)
    return sorted(rows, key=lambda r: order.index(r["case"]) if r["case"] in order else len(order))


def _result(rows: list[dict[str, Any]], args: argparse.Namespace, cas: Any, ost: Any, t0: float) -> dict[str, Any]:
    return {"memory": args.memory, "tools": peers.versions(), "cases": rows, "chart": f"{args.out}.png",
            "rate_kbit": args.rate_kbit or None,
            "casync_seed_seconds": cas.seed_seconds if cas else None,
            "ostree_old_commit_seconds": ost.commit_seconds if ost else None,
            "desync": "not measured: `go install github.com/folbricht/desync/cmd/desync@latest` failed — the Go "
                      "module proxy answered 403 'This module version is not available' and GOPROXY=direct "
                      "cannot reach the source host; casync (same scheme, from Debian) stands in",
            "goals": "HCP <= 0.8 x .deb bytes on installs >= 10 MB; HCP smallest of all peers (goals: at the "
                     "default zstd level 3; goals_high: at the high level; goals_xz: with xz)",
            "bookworm_updates_security": "apt-get -s upgrade on the test image's dpkg status against the "
                                         "bookworm, bookworm-updates and bookworm-security lists: 0 upgraded "
                                         "(the image is built from them), so the update case uses backports",
            "seconds": round(time.monotonic() - t0, 1),
            "note": "MB = 10^6 bytes; every peer's figure is what it would send to a host holding the parent"}


if __name__ == "__main__":
    main()
