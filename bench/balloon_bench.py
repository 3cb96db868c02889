"""B2, active migration (§5.2, Fig. 6): what ballooning and a primed hash
cache save when a running capsule moves, for two guests:

- ``desktop``: an idle Debian guest that has used and freed memory (an
  application opened and closed) and holds files in its page cache;
- ``working-set``: a Debian guest whose process keeps a large working set
  (the paper's Apache case, where ballooning can hurt);
- ``desktop-no-fpr``: the desktop guest booted without free-page reporting,
  to see what reporting alone does.

Peer: libvirt's own migration stream of the same guest, zstd-compressed
(`virsh save --image-format zstd`: the stream native migration with
compression sends), at the same link's goodput. Measured rather than
computed, live between two separate hosts over a shaped link (``virsh migrate
--live`` plain and multifd + zstd against ``capsule migrate``): bench/livemigrate.py.

For each of none / balloon (agent) / balloon (virtio) / primed / balloon +
primed: the memory image's non-zero bytes, HCP bytes on the wire to a host
that has the image's disk but not this memory, the time until the capsule
runs on the 384 kbit/s link (wire bytes at the link's measured goodput plus
the restore), and the workload's run time after the resume.

    .venv/bin/python bench/balloon_bench.py [--memory 512M]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import table, workdir, write_result  # noqa: E402
from capsule import capsules, images, lifecycle, transfer  # noqa: E402
from capsule.agent.launch import AgentProcess  # noqa: E402
from capsule.console.serial import ConsoleSession  # noqa: E402
from capsule.runtime.connection import libvirt_uri  # noqa: E402
from capsule.runtime.guestagent import wait_for_agent  # noqa: E402
from capsule.store import Store  # noqa: E402
from testkit.images import IMAGE_HOME, destroy_domains  # noqa: E402

GOODPUT_BPS = 370_000 / 8     # 384 kbit/s tbf measured at 370 kbit/s of TCP goodput (testkit/netlink.py)
WORKLOADS = {
    "desktop": ("python3 -c \"b = bytearray(b'Z') * (150 << 20); del b\"; "
                "cat /usr/lib/x86_64-linux-gnu/*.so* > /dev/null 2>&1; true"),
    "working-set": ("cat /usr/lib/x86_64-linux-gnu/*.so* > /dev/null 2>&1; "
                    "nohup python3 -c \"import time; b = bytearray(b'W') * (250 << 20)\n"
                    "while True: time.sleep(3600)\" >/dev/null 2>&1 & sleep 8"),
}
# the workload after the resume: read back what was in the page cache before (cold if it was dropped)
TOUCH = ("python3 -c \"import glob, time; t = time.monotonic(); "
         "[open(p, 'rb').read() for p in glob.glob('/usr/lib/x86_64-linux-gnu/*.so*')]; "
         "print(round(time.monotonic() - t, 3))\"")
CASES = [("none", None, "agent", False), ("balloon", "cache", "agent", False),
         ("balloon-virtio", "cache", "virtio", False), ("primed", None, "agent", True),
         ("balloon-primed", "cache", "agent", True)]


def guest(store: Store, name: str, cmd: str, timeout: float = 300) -> str:
    with ConsoleSession(store.domain_name(name)) as c:
        return c.run(cmd, timeout=timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", default="512M")
    args = ap.parse_args()
    work = workdir("capsule-b2-")
    agents: list[AgentProcess] = []
    stores: list[Store] = []
    try:
        src = Store.open(IMAGE_HOME)
        images.build(src, "debian", "debian")
        a = Store.open(work / "a")
        stores.append(a)
        images.import_image(src, a, "debian")
        results = []
        rows = []
        for wname, workload, fpr in [(w, cmd, True) for w, cmd in WORKLOADS.items()] + [
                ("desktop-no-fpr", WORKLOADS["desktop"], False)]:
            base = f"{wname}-base"
            capsules.create(a, base, "debian", memory=args.memory, free_page_reporting=fpr)
            lifecycle.start(a, base, timeout=300)
            wait_for_agent(a.instance_dir(base) / "agent.sock", timeout=120)
            guest(a, base, workload)
            # the peer: libvirt's own migration stream of the same guest, zstd-compressed (what native
            # migration with compression sends; taken with `virsh save --image-format zstd`)
            peer_file = work / f"{wname}.virsh-zstd"
            virsh = ["virsh", "-q", "-c", libvirt_uri()]
            subprocess.run([*virsh, "save", a.domain_name(base), str(peer_file), "--image-format", "zstd"],
                           check=True, capture_output=True)
            peer_bytes = peer_file.stat().st_size
            subprocess.run([*virsh, "restore", str(peer_file)], check=True, capture_output=True)
            peer_file.unlink()
            results.append({"workload": wname, "case": "libvirt migration stream, zstd",
                            "hcp_wire_bytes": peer_bytes,
                            "seconds_until_running_at_384kbit": round(peer_bytes / GOODPUT_BPS, 1)})
            rows.append([wname, "libvirt stream + zstd (peer)", "", f"{peer_bytes / 2**20:.2f}",
                         f"{peer_bytes / GOODPUT_BPS:.0f}", ""])
            snap, _ = lifecycle.snapshot(a, base)
            assert snap.version is not None   # a snapshot records a version
            lifecycle.stop(a, base, force=True)
            for case, policy, method, primed in (CASES if fpr else CASES[:2]):
                name = f"{wname}-{case}"
                capsules.derive(a, snap.version.ref, name)
                lifecycle.start(a, name)
                sealed = lifecycle.suspend(a, name, balloon=policy, balloon_method=method)
                assert sealed.version is not None and sealed.memory is not None   # a suspend records both
                # a receiving host that has the disk image but none of this memory
                b = Store.open(work / f"b-{name}")
                stores.append(b)
                images.import_image(src, b, "debian")
                debian = b.catalogue.image("debian")
                assert debian is not None   # (just imported)
                if primed:  # the receiver's cache knows its own copy of the guest's disk
                    b.hash_cache().prime_paths([b.layer_path(debian.root_layer)])
                b.close()
                agent = AgentProcess(b.home, work / f"b-{name}.token")
                agents.append(agent)
                push = transfer.push(a, sealed.version.ref, agent.url, agent.token)
                agent.stop()
                b = Store.open(work / f"b-{name}")
                stores.append(b)
                t = time.monotonic()
                lifecycle.start(b, name)
                restore = time.monotonic() - t
                wait_for_agent(b.instance_dir(name) / "agent.sock", timeout=120)
                run_s = float(guest(b, name, TOUCH))
                lifecycle.stop(b, name, force=True)
                link_s = push.wire_bytes / GOODPUT_BPS + restore
                entry: dict[str, Any] = {
                    "workload": wname, "case": case, "memory_nonzero_bytes": sealed.memory.stored_bytes,
                    "balloon_held_bytes": sealed.balloon.held_bytes if sealed.balloon else 0,
                    "hcp_wire_bytes": push.wire_bytes, "restore_seconds": round(restore, 2),
                    "seconds_until_running_at_384kbit": round(link_s, 1), "workload_seconds_after_resume": run_s}
                results.append(entry)
                rows.append([wname, case, f"{entry['memory_nonzero_bytes'] / 2**20:.1f}",
                             f"{entry['hcp_wire_bytes'] / 2**20:.2f}", f"{link_s:.0f}", f"{run_s:.2f}"])
        path = write_result("balloon_b2", {"memory": args.memory, "goodput_bytes_per_s": GOODPUT_BPS,
                                           "results": results,
                                           "note": "time at 384 kbit/s = wire bytes / measured goodput + restore"})
        table("B2: active migration (MiB; s)", ["guest", "case", "memory non-zero", "HCP wire", "until running",
                                                "workload after resume"], rows)
        print(f"→ {path}")
    finally:
        for ag in agents:
            ag.stop()
        for s in stores:
            destroy_domains(s)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
