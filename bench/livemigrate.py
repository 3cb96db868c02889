"""B2-live over a real link: libvirt's own live migration against ``capsule migrate`` (live by default, and
``--offline``), between two separate hosts (the compose hosts: a container each, with its own libvirtd and store
at a different path), over the same shaped link, in one run.

The guest (``--guest tiny``, the default): the tiny image, 256 MiB, booted by Capsule on host A, with the same
content written by the same workload (16 MiB of random bytes and ~30 MiB of compressible text in its tmpfs, 8 MiB
of random bytes on its disk); with ``--dirty 2,20`` also while a dirtier rewrites 2 (or 20) MiB of its memory every
second. ``--guest desktop``: the desktop image with 1 GiB, the same content (the disk's in a file), and B4's office
day (bench/office_workload.py) running from 30 s before the move on. Host B holds the image (its layers, pushed
before), not the guest. The commute cases (``--cases capsule-commute,virsh-zstd-commute``): B also holds
yesterday's version of the capsule. The cases (bench/livepeers.py):

- ``virsh migrate --live --copy-storage-inc`` with multifd (2 connections) + zstd and auto-converge;
- ``virsh migrate --live --postcopy --postcopy-after-precopy``;
- ``capsule migrate`` (live: T0 disks by HCP, memory through the tunnel's codec, auto-converge);
- ``capsule migrate --offline`` (suspend, HCP push of disks and memory image, start there).

Figures for each: total seconds (the command's wall time on A), the pause as the guest lived it (its uptime
against the host's clock before and after: testkit/guestclock.py) and QEMU's own downtime where there is one,
bytes on the link (its counters, both ways, headers included), and whether the content arrived intact. The
post-copy peer's stall time (``postcopy-blocktime``) is not measured: libvirt does not report it.

The link (bench/looplink.py): htb on ``lo`` for the proxies' ports only, the same rate each way, and
testkit/delayproxy.py's delay; everything between the hosts crosses it (libvirt's connection to B, QEMU's
migration stream and NBD, the agents' HTTP and so Capsule's tunnel).

    .venv/bin/python -m bench.livemigrate   # as root [--rate-kbit 8000] [--rtt-ms 20] [--dirty 0,2,20]

Brings its own compose project up (capsule-b2, agents on 7371/7372, libvirtd on 127.0.0.1:16571/16572 without
authentication, QEMU migration ports 49380-49389/49390-49399) and takes it down (volumes too) at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import livepeers  # noqa: E402
from bench.common import table, temp_workdir, write_result  # noqa: E402
from bench.livepeers import CASES, COMMUTE, Link  # noqa: E402
from bench.looplink import LoopLink  # noqa: E402
from scripts import composehosts as hc  # noqa: E402
from testkit.images import IMAGE_HOME  # noqa: E402

ENV = {"CAPSULE_HOST_A_LISTEN": "127.0.0.1:7371", "CAPSULE_HOST_B_LISTEN": "127.0.0.1:7372",
             "CAPSULE_HOST_A_LIBVIRT_TCP": "127.0.0.1:16571", "CAPSULE_HOST_B_LIBVIRT_TCP": "127.0.0.1:16572",
             "CAPSULE_HOST_A_MIGRATION_PORTS": "49380-49389", "CAPSULE_HOST_B_MIGRATION_PORTS": "49390-49399",
             "CAPSULE_HOST_IMAGE": "capsule-host:b2", "CAPSULE_S3_PORT": "7373"}
PROJECT = hc.Project("capsule-b2", ENV)   # this bench's own compose project, ports and image
B_LIBVIRT = 16572
B_AGENT = 7372
MIGRATION_PORT, NBD_PORT = 49390, 49391   # B's QEMU listens on 127.0.0.2:PORT, the proxy on 127.0.0.1:PORT
LINK_LIBVIRT, LINK_AGENT = 20572, 20372   # proxies for B's libvirtd and B's agent
FAR = "127.0.0.2"

def seed(a: hc.Host, b: hc.Host, guest: livepeers.Guest) -> None:
    """Capsule `seed` (the guest's image and memory) on both hosts, pushed from a store on this machine."""
    from capsule import capsules, images, transfer
    from capsule.store import Store
    from testkit.images import ensure_image

    src = Store.open(IMAGE_HOME)
    ensure_image(src, guest.image)
    with temp_workdir("capsule-b2-") as tmp:
        local = Store.open(Path(tmp) / "store")
        images.import_image(src, local, guest.image)
        capsules.create(local, "seed", guest.image, memory=guest.memory)
        for h in (a, b):
            transfer.push(local, "seed", h.url, h.token)
        local.close()


def run_case(a: hc.Host, b: hc.Host, link: Link, key: str, dirty: int, n: int) -> dict[str, Any]:
    run, kind = (CASES | COMMUTE)[key]
    name = f"{key.replace('-', '')}{dirty}m{n}"
    try:
        row = run(a, b, link, name, kind, dirty, commute=key in COMMUTE)
    except hc.HostCommandFailed as e:   # recorded as it failed, never as a figure
        with contextlib.suppress(hc.HostCommandFailed):
            a.capsule("stop", name, "--force")
        row = {"case": key, "error": str(e)}
    return {"dirty_mib_s": dirty, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-kbit", type=int, default=8000)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--dirty", default="0,2,20", help="dirtier rates (MiB/s) to run every case at (0: none)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"which of {', '.join(CASES)}; or of the commute case, {', '.join(COMMUTE)}")
    ap.add_argument("--tag", default="", help="a suffix for the result's file name (a run of some cases only)")
    ap.add_argument("--guest", choices=sorted(livepeers.GUESTS), default="tiny",
                    help="tiny (256 MiB, the default) or desktop (the desktop image, 1 GiB, running B4's office day "
                         "during the move)")
    ap.add_argument("--mss", type=int, default=0,
                    help="the TCP segment size senders use across the link (e.g. 1448, an Ethernet path's; default: "
                         "loopback's 64 KiB, whose segments keep TCP's queue at the link long)")
    ap.add_argument("--keep-hosts", action="store_true", help="leave the compose project up")
    args = ap.parse_args()
    guest = livepeers.use_guest(args.guest)
    dirty = [int(x) for x in args.dirty.split(",")]
    cases = args.cases.split(",")
    if unknown := [c for c in cases if c not in CASES | COMMUTE]:
        sys.exit(f"unknown case(s) {unknown}: choose from {list(CASES | COMMUTE)}")
    if why := hc.docker_ready():
        sys.exit(why)
    print("[b2] bringing up the compose hosts (project capsule-b2)", file=sys.stderr)
    PROJECT.compose("down", "--volumes", "--timeout", "5")
    PROJECT.up()
    a, b = PROJECT.host("host-a"), PROJECT.host("host-b")
    results: list[dict[str, Any]] = []
    try:
        seed(a, b, guest)
        with LoopLink(args.rate_kbit, args.rtt_ms, args.mss) as shaped:
            shaped.forward(LINK_LIBVIRT, "127.0.0.1", B_LIBVIRT)
            shaped.forward(LINK_AGENT, "127.0.0.1", B_AGENT)
            shaped.forward(MIGRATION_PORT, FAR, MIGRATION_PORT)
            shaped.forward(NBD_PORT, FAR, NBD_PORT)
            link = Link(shaped, LINK_LIBVIRT, LINK_AGENT, MIGRATION_PORT, NBD_PORT, FAR)
            for d in dirty:
                for n, key in enumerate(cases):
                    print(f"[b2] {key}, dirtier {d} MiB/s, over {args.rate_kbit} kbit/s, {args.rtt_ms:g} ms RTT",
                          file=sys.stderr)
                    results.append(run_case(a, b, link, key, d, n))
                    r = results[-1]
                    if "error" in r:
                        print(f"[b2]   failed: {r['error'][-2000:]}", file=sys.stderr)
                    print(f"[b2]   {r.get('seconds', 'failed')} s, paused {r.get('paused_ms')} ms, "
                          f"{r.get('wire_bytes')} bytes on the link", file=sys.stderr)
    finally:
        if not args.keep_hosts:
            PROJECT.compose("down", "--volumes", "--timeout", "5")
    name = (f"livemigrate_b2_{args.rate_kbit}kbit" + ("" if args.guest == "tiny" else f"_{args.guest}")
            + (f"_{args.tag}" if args.tag else ""))
    described = f"{guest.image}, {guest.memory.replace('M', ' MiB').replace('G', ' GiB')}"
    path = write_result(name, {
        "rate_kbit": args.rate_kbit, "rtt_ms": args.rtt_ms, "mss": args.mss or None,
        "guest": described + (", office day running" if guest.office else ""),
        "results": results,
        "ratios": ratios(results),
        "note": "seconds = the command's wall time on host A; paused = the guest's uptime against the host's "
                "clock (testkit/guestclock.py); downtime = QEMU's (libvirt's job statistics); wire = the link's "
                "byte counters (both ways, headers included)"})
    chart(results, path.with_suffix(".png"), args.rate_kbit, described)
    mib = 2**20
    table(f"B2-live: {args.rate_kbit} kbit/s, {args.rtt_ms:g} ms RTT, {described} (s; MiB)",
          ["dirtier MiB/s", "peer", "total", "paused (guest)", "QEMU downtime", "on the link", "intact"],
          [[r["dirty_mib_s"], r["case"], "failed", r["error"].splitlines()[-1][:60], "", "", ""] if "error" in r else
           [r["dirty_mib_s"], r["case"], f"{r['seconds']:.1f}", f"{r['paused_ms'] / 1000:.2f} ± "
            f"{r['paused_error_ms'] / 1000:.2f}", "" if r.get("downtime_ms") is None else
            f"{r['downtime_ms'] / 1000:.2f}", f"{r['wire_bytes'] / mib:.1f}", r["content_intact"]] for r in results])
    print(f"→ {path}")


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Capsule's live move against libvirt's multifd + zstd, for each dirtier rate: bytes, total time, pause."""
    out = []
    for d, tail in dict.fromkeys((r["dirty_mib_s"], ", commute" if r["case"].endswith(", commute") else "")
                                 for r in results):
        mine = next((r for r in results if r["dirty_mib_s"] == d and r["case"] == "capsule migrate" + tail), None)
        peer = next((r for r in results if r["dirty_mib_s"] == d and r["case"] == "virsh --live multifd+zstd" + tail),
                    None)
        if mine and peer and "error" not in mine and "error" not in peer:
            out.append({"dirty_mib_s": d, "commute": bool(tail),
                        "bytes": round(mine["wire_bytes"] / peer["wire_bytes"], 3),
                        "seconds": round(mine["seconds"] / peer["seconds"], 3),
                        "paused": round(mine["paused_ms"] / max(peer["paused_ms"], 1), 3)})
    return out


def chart(results: list[dict[str, Any]], path: Path, rate_kbit: int, guest: str = "tiny guest, 256 MiB") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if "error" not in r]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['case']}\n{r['dirty_mib_s']} MiB/s dirtied" for r in rows]
    colors = ["tab:green" if r["case"].startswith("capsule migrate") and "--" not in r["case"] else "tab:gray"
              for r in rows]
    axes[0].barh(labels, [r["paused_ms"] / 1000 for r in rows], color=colors)
    axes[0].set_xlabel("paused, as the guest lived it (s)")
    axes[1].barh(labels, [r["wire_bytes"] / 2**20 for r in rows], color=colors)
    axes[1].set_xlabel("bytes on the link (MiB)")
    for ax in axes:
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
    axes[1].set_yticklabels([])
    fig.suptitle(f"B2-live: {guest}, over {rate_kbit} kbit/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
