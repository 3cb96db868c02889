"""B2 over a real link: libvirt's own live migration against ``capsule migrate``,
between two separate hosts (the compose hosts: a container each, with its own
libvirtd and store at a different path), over the same shaped link.

The guest: the tiny image, 256 MiB, booted by Capsule on host A, with the same
content written by the same workload (16 MiB of random bytes and ~30 MiB of
compressible text in its tmpfs, 8 MiB of random bytes on its disk). Host B
holds the image (the tiny image's layers, pushed before), not the guest.

- ``virsh migrate --live --copy-storage-inc``: memory pre-copy while the guest
  runs, the disk's top layer over NBD (B's copy precreated on B's own copy of
  the image's layer); ``zstd``: the same with ``--parallel`` (multifd, 2
  connections) ``--compressed --comp-methods zstd``. Downtime and memory data
  from ``virsh domjobinfo --completed --rawstats`` on B (NBD's disk bytes are
  not in libvirt's job statistics: they show in the link's counters only).
- ``capsule migrate --mode full`` (and ``--balloon``, policy ``cache``, virtio):
  the library call the CLI makes, run on A: (balloon,) suspend, push, start on
  B. Downtime: from the save phase's start (the guest pauses) to running on B.

Each case checks that the guest's tmpfs content is intact on B (digests).

The link (bench/looplink.py): htb on ``lo`` for the proxies' ports only, the
same rate each way, and testkit/delayproxy.py's delay; everything between the
hosts crosses it (libvirt's connection to B, QEMU's migration stream and NBD,
the agents' HTTP). Bytes on the wire are the link's counters.

    .venv/bin/python -m bench.livemigrate   # as root (tc on lo, docker) [--rate-kbit 8000] [--rtt-ms 20]

Brings its own compose project up (capsule-b2, agents on 7371/7372, libvirtd on
127.0.0.1:16571/16572 without authentication, QEMU migration ports
49380-49389/49390-49399) and takes it down (volumes too) at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import table, temp_workdir, write_result  # noqa: E402
from bench.jobstats import job_figures, parse_rawstats  # noqa: E402
from bench.looplink import LoopLink  # noqa: E402
from scripts import composehosts as hc  # noqa: E402
from testkit.images import IMAGE_HOME  # noqa: E402

ENV = {"CAPSULE_HOST_A_LISTEN": "127.0.0.1:7371", "CAPSULE_HOST_B_LISTEN": "127.0.0.1:7372",
             "CAPSULE_HOST_A_LIBVIRT_TCP": "127.0.0.1:16571", "CAPSULE_HOST_B_LIBVIRT_TCP": "127.0.0.1:16572",
             "CAPSULE_HOST_A_MIGRATION_PORTS": "49380-49389", "CAPSULE_HOST_B_MIGRATION_PORTS": "49390-49399",
             "CAPSULE_HOST_IMAGE": "capsule-host:b2"}
PROJECT = hc.Project("capsule-b2", ENV)   # this bench's own compose project, ports and image
B_LIBVIRT = 16572
B_AGENT = 7372
MIGRATION_PORT, NBD_PORT = 49390, 49391   # B's QEMU listens on 127.0.0.2:PORT, the proxy on 127.0.0.1:PORT
LINK_LIBVIRT, LINK_AGENT = 20572, 20372   # proxies for B's libvirtd and B's agent
FAR = "127.0.0.2"

WORKLOAD = ("dd if=/dev/urandom of=/tmp/random bs=1M count=16 2>/dev/null; seq 1 4000000 > /tmp/text; "
            "dd if=/dev/urandom of=/dev/vda bs=1M count=8 seek=32 conv=fsync 2>/dev/null; sync; "
            "md5sum /tmp/random /tmp/text | md5sum")
CHECK = "md5sum /tmp/random /tmp/text | md5sum"
VIRSH = ["virsh", "-q", "-c", "qemu:///system"]


def _write(host: hc.Host, path: str, text: str) -> None:
    subprocess.run([hc.DOCKER, "exec", "-i", host.container, "sh", "-c", f"cat > {path}"], input=text, text=True,
                   check=True, env=PROJECT.env())


def _guest_by_domain(host: hc.Host, domain: str, command: str, timeout: float = 60) -> str:
    args = ["/opt/capsule/.venv/bin/python", "-c", hc._GUEST_SHELL, domain, command, str(timeout)]
    return host._exec(args, timeout=timeout + 30).stdout.strip()


def prepare(a: hc.Host, name: str) -> str:
    """A new capsule on A, started, with the workload's content; the digest of that content."""
    a.capsule("derive", "seed", name)
    a.capsule("start", name)
    return a.guest(name, WORKLOAD, timeout=300).split()[0]


def virsh_move(a: hc.Host, b: hc.Host, link: LoopLink, name: str, zstd: bool) -> dict[str, Any]:
    digest = prepare(a, name)
    dom = a.domain(name)
    a_home, b_home = a.home, b.home
    xml = a.sh(f"virsh -c qemu:///system dumpxml --migratable {dom}")
    _write(a, f"/tmp/{name}.xml", xml.replace(a_home, b_home))
    # B: the disk's top layer precreated over B's own copy of the image's layer; the instance's directory
    found = re.search(r"<source file='([^']+)'", xml)
    assert found is not None, "the domain has no file disk"
    leaf = found.group(1)
    info = json.loads(a.sh(f"qemu-img info -U --output=json {leaf}"))
    b_leaf = leaf.replace(a_home, b_home)
    b.sh(f"mkdir -p {b_home}/instances/{name} && cd {os.path.dirname(b_leaf)} && "
         f"qemu-img create -q -f qcow2 -F qcow2 -b {info['backing-filename']} {b_leaf} {info['virtual-size']}")
    flags = ["--live", "--copy-storage-inc", "--xml", f"/tmp/{name}.xml",
             "--migrateuri", f"tcp://127.0.0.1:{MIGRATION_PORT}", "--listen-address", FAR,
             "--disks-port", str(NBD_PORT)]   # NBD: B listens on the listen address, A connects to the URI's host
    if zstd:
        flags += ["--parallel", "--parallel-connections", "2", "--compressed", "--comp-methods", "zstd"]
    before = link.wire_bytes()
    t = time.monotonic()
    a.sh(" ".join([*VIRSH, "migrate", *flags, dom, f"qemu+tcp://127.0.0.1:{LINK_LIBVIRT}/system"]), timeout=1800)
    seconds = time.monotonic() - t
    wire = link.wire_bytes() - before
    stats = parse_rawstats(b.sh(f"virsh -c qemu:///system domjobinfo --completed --rawstats {dom}"))
    moved = _guest_by_domain(b, dom, CHECK).split()[0]
    b.sh(f"virsh -c qemu:///system destroy {dom}; rm -rf {b_leaf} {b_home}/instances/{name}")
    return {"case": "virsh migrate --live" + (" --parallel zstd" if zstd else ""), "seconds": round(seconds, 2),
            "wire_bytes": wire, "content_intact": moved == digest, **job_figures(stats), "raw": stats}


# Run on host A: what `capsule migrate` calls (capsule.migrate.migrate), with each phase's start time, so the
# downtime is measured from the save (the guest pauses) to the resume there, not from the live balloon phase
_CAPSULE_MIGRATE = """
import json, os, sys
from pathlib import Path
from capsule import migrate
from capsule.store import Store
starts = {}
r = migrate.migrate(Store.open(Path(os.environ["CAPSULE_HOME"])), sys.argv[1], sys.argv[2],
                    os.environ["CAPSULE_TOKEN"], mode="full", balloon=sys.argv[3] or None,
                    on_event=lambda s: starts.setdefault(s.phase, s.elapsed))
print(json.dumps({"seconds": r.seconds, "phase_starts": starts, "push": r.push.as_dict() if r.push else None,
                  "remote": r.remote}))
"""


def capsule_move(a: hc.Host, b: hc.Host, link: LoopLink, name: str, balloon: bool) -> dict[str, Any]:
    digest = prepare(a, name)
    before = link.wire_bytes()
    t = time.monotonic()
    out = a._exec(["/opt/capsule/.venv/bin/python", "-c", _CAPSULE_MIGRATE, name, f"http://127.0.0.1:{LINK_AGENT}",
                   "cache" if balloon else ""], env={"CAPSULE_TOKEN": b.token}, timeout=1800).stdout
    seconds = time.monotonic() - t
    wire = link.wire_bytes() - before
    r = json.loads(out.strip().splitlines()[-1])
    moved = b.guest(name, CHECK).split()[0]
    b.capsule("stop", name, "--force")
    return {"case": "capsule migrate --mode full" + (" --balloon" if balloon else ""),
            "seconds": round(seconds, 2), "wire_bytes": wire, "content_intact": moved == digest,
            "downtime_ms": round((r["seconds"] - r["phase_starts"]["save"]) * 1000),
            "hcp_wire_bytes": (r["push"] or {}).get("wire_bytes"), "raw": r}


def seed(a: hc.Host, b: hc.Host) -> None:
    """Capsule `seed` (tiny image, 256 MiB) on both hosts, pushed from a store on this machine."""
    from capsule import capsules, images, transfer
    from capsule.store import Store

    src = Store.open(IMAGE_HOME)
    images.build(src, "tiny", "tiny")
    with temp_workdir("capsule-b2-") as tmp:
        local = Store.open(Path(tmp) / "store")
        images.import_image(src, local, "tiny")
        capsules.create(local, "seed", "tiny", memory="256M")
        for h in (a, b):
            transfer.push(local, "seed", h.url, h.token)
        local.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-kbit", type=int, default=8000)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--keep-hosts", action="store_true", help="leave the compose project up")
    args = ap.parse_args()
    if why := hc.docker_ready():
        sys.exit(why)
    print("[b2] bringing up the compose hosts (project capsule-b2)", file=sys.stderr)
    PROJECT.compose("down", "--volumes", "--timeout", "5")
    PROJECT.up()
    a, b = PROJECT.host("host-a"), PROJECT.host("host-b")
    results: list[dict[str, Any]] = []
    try:
        seed(a, b)
        with LoopLink(args.rate_kbit, args.rtt_ms) as link:
            link.forward(LINK_LIBVIRT, "127.0.0.1", B_LIBVIRT)
            link.forward(LINK_AGENT, "127.0.0.1", B_AGENT)
            link.forward(MIGRATION_PORT, FAR, MIGRATION_PORT)
            link.forward(NBD_PORT, FAR, NBD_PORT)
            cases = [("virsh-plain", virsh_move, False), ("virsh-zstd", virsh_move, True),
                     ("capsule", capsule_move, False), ("capsule-balloon", capsule_move, True)]
            for name, run, opt in cases:
                print(f"[b2] {name} over {args.rate_kbit} kbit/s, {args.rtt_ms:g} ms RTT", file=sys.stderr)
                try:
                    results.append(run(a, b, link, name, opt))
                except hc.HostCommandFailed as e:   # recorded as it failed, never as a figure
                    results.append({"case": name, "error": str(e)})
                    print(f"[b2] {name} failed: {e}", file=sys.stderr)
                    with contextlib.suppress(hc.HostCommandFailed):
                        a.capsule("stop", name, "--force")
                    continue
                print(f"[b2] {name}: {results[-1]['seconds']} s, {results[-1]['wire_bytes']} bytes on the link",
                      file=sys.stderr)
    finally:
        if not args.keep_hosts:
            PROJECT.compose("down", "--volumes", "--timeout", "5")
    path = write_result(f"livemigrate_b2_{args.rate_kbit}kbit", {
        "rate_kbit": args.rate_kbit, "rtt_ms": args.rtt_ms, "guest": "tiny, 256 MiB", "workload": WORKLOAD,
        "results": results,
        "note": "measured on the link: seconds = the command's wall time on host A; wire = the link's byte "
                "counters (both ways, headers included); virsh downtime from domjobinfo --completed on B"})
    mib = 2**20
    table(f"B2 live: {args.rate_kbit} kbit/s, {args.rtt_ms:g} ms RTT, tiny guest 256 MiB (s; MiB)",
          ["peer", "total", "downtime", "on the link", "libvirt: memory processed", "content intact"],
          [[r["case"], "failed", "", "", r["error"].splitlines()[-1][:80], ""] if "error" in r else
           [r["case"], f"{r['seconds']:.1f}", f"{r['downtime_ms'] / 1000:.2f}", f"{r['wire_bytes'] / mib:.1f}",
            f"{r['memory_processed_bytes'] / mib:.1f}" if "memory_processed_bytes" in r else "",
            r["content_intact"]] for r in results])
    print(f"→ {path}")


if __name__ == "__main__":
    main()
