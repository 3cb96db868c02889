"""The cases of B2-live (bench/livemigrate.py), each one move of a fresh capsule from host A to host B over the
shaped link: libvirt's own live migration (``virsh migrate``) and ``capsule migrate`` (live, or ``--offline``).

Every case starts the same way (:func:`prepare`): a capsule derived from ``seed`` is started on A, the workload
writes the same content, and a dirtier (if asked) keeps rewriting N MiB of its memory every second. Every case
ends the same way: the guest's clock against the host's gives the pause as the guest lived it
(testkit/guestclock.py), the content's digest is checked on B, and the guest is destroyed there.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.jobstats import job_figures, parse_rawstats
from bench.looplink import LoopLink
from scripts import composehosts as hc
from testkit import guestclock

VIRSH = ["virsh", "-q", "-c", "qemu:///system"]
WORKLOAD = ("dd if=/dev/urandom of=/tmp/random bs=1M count=16 2>/dev/null; seq 1 4000000 > /tmp/text; "
            "dd if=/dev/urandom of=/dev/vda bs=1M count=8 seek=32 conv=fsync 2>/dev/null; sync; "
            "md5sum /tmp/random /tmp/text | md5sum")
CHECK = "md5sum /tmp/random /tmp/text | md5sum"
TODAY = ("dd if=/dev/urandom bs=1M count=4 2>/dev/null >> /tmp/random; seq 4000001 4400000 >> /tmp/text; "
         "md5sum /tmp/random /tmp/text | md5sum")
# the desktop's root file system is its disk: the same content in its tmpfs and in a file
DESKTOP_WORKLOAD = ("dd if=/dev/urandom of=/dev/shm/random bs=1M count=16 2>/dev/null; seq 1 4000000 > /dev/shm/text; "
                    "dd if=/dev/urandom of=/root/disk.bin bs=1M count=8 conv=fsync 2>/dev/null; sync; "
                    "md5sum /dev/shm/random /dev/shm/text /root/disk.bin | md5sum")
DESKTOP_CHECK = "md5sum /dev/shm/random /dev/shm/text /root/disk.bin | md5sum"
DESKTOP_TODAY = ("dd if=/dev/urandom bs=1M count=4 2>/dev/null >> /dev/shm/random; "
                 "seq 4000001 4400000 >> /dev/shm/text; md5sum /dev/shm/random /dev/shm/text /root/disk.bin | md5sum")
OFFICE = Path(__file__).resolve().parent / "office_workload.py"
OFFICE_WARMUP_S = 30       # seconds the office day runs before the move


@dataclass(frozen=True)
class Guest:
    """The guest every case moves: its image and memory, the content written before the move and checked after,
    today's work of the commute case, and whether B4's office day runs in it during the move."""

    image: str
    memory: str
    workload: str
    check: str
    today: str
    office: bool = False
    start_timeout: float = 300


GUESTS = {"tiny": Guest("tiny", "256M", WORKLOAD, CHECK, TODAY),
          "desktop": Guest("desktop", "1G", DESKTOP_WORKLOAD, DESKTOP_CHECK, DESKTOP_TODAY, office=True,
                           start_timeout=900)}
GUEST = GUESTS["tiny"]     # the run's (bench/livemigrate.py --guest)


def use_guest(key: str) -> Guest:
    global GUEST
    GUEST = GUESTS[key]
    return GUEST


DIRTIER = ("(while :; do dd if=/dev/urandom of=/dev/shm/dirty bs=1M count={mib} conv=notrunc 2>/dev/null; "
           "sleep 1; done) </dev/null >/dev/null 2>&1 &")


@dataclass(frozen=True)
class Link:
    """Where B is reached across the shaped link, and the link's counters."""

    link: LoopLink
    libvirt: int           # port of the proxy in front of B's libvirtd
    agent: int             # port of the proxy in front of B's agent
    migration: int         # B's QEMU migration port (the proxy listens on 127.0.0.1, B's QEMU on FAR)
    nbd: int
    far: str


def prepare(a: hc.Host, name: str, dirty_mib: int, commute: bool = False, b: hc.Host | None = None) -> str:
    """A new capsule on A, started, with the workload's content (and the dirtier); the content's digest.

    ``commute``: the commute case. The capsule is suspended after the workload and that version pushed to B
    (beside the shaped link: yesterday's version, which B holds before the move is measured), then resumed on
    A, where today's work (:data:`TODAY`) adds 4 MiB of new random bytes and 400,000 lines of text."""
    a.capsule("derive", "seed", name)
    a.capsule("start", name, timeout=GUEST.start_timeout)
    digest = a.guest(name, GUEST.workload, timeout=300).split()[0]
    if commute and b is not None:
        a.capsule("suspend", name, timeout=900)
        a.capsule("push", name, "--to", b.url, token=b.token, timeout=1800)   # beside the link: not the move
        a.capsule("start", name, timeout=900)
        digest = a.guest(name, GUEST.today, timeout=300).split()[0]
    if GUEST.office:
        _office(a, name)
    if dirty_mib:
        a.guest(name, DIRTIER.format(mib=dirty_mib))
        time.sleep(3)
    return digest


def _office(a: hc.Host, name: str) -> None:
    """B4's office day started in the guest (sent through its serial console in lines a tty takes), left to run
    for :data:`OFFICE_WARMUP_S` seconds: it goes on during the move."""
    text = base64.b64encode(gzip.compress(OFFICE.read_bytes())).decode()
    a.guest(name, "rm -f /root/office.b64")
    for at in range(0, len(text), 1500):
        a.guest(name, f"printf %s {text[at:at + 1500]} >> /root/office.b64")
    a.guest(name, "base64 -d /root/office.b64 | gunzip > /root/office_workload.py && "
                  "(nohup setsid python3 /root/office_workload.py > /root/office.log 2>&1 < /dev/null &)")
    time.sleep(OFFICE_WARMUP_S)


def _by_domain(host: hc.Host, domain: str, command: str, timeout: float = 60) -> str:
    args = ["/opt/capsule/.venv/bin/python", "-c", hc._GUEST_SHELL, domain, command, str(timeout)]
    return host._exec(args, timeout=timeout + 30).stdout.strip()


def _write(host: hc.Host, path: str, text: str) -> None:
    subprocess.run([hc.DOCKER, "exec", "-i", host.container, "sh", "-c", f"cat > {path}"], input=text, text=True,
                   check=True, env=host.project.env())


# Run on B: its store passable by QEMU, the leaf lent read-write, the layer below it and the other files read-only
_LEND = """
import json, subprocess, sys
from pathlib import Path
from capsule.runtime import guestaccess as g
home, leaf, *files = map(Path, sys.argv[1:])
g.grant_store(home)
g.lend(leaf, writable=True)
chain = json.loads(subprocess.run(["qemu-img", "info", "-U", "--backing-chain", "--output=json", str(leaf)],
                                  capture_output=True, text=True, check=True).stdout)
for f in [*(Path(i["filename"]) for i in chain[1:]), *files]:
    if f.is_file():
        g.lend(f, writable=False)
"""


def virsh_move(a: hc.Host, b: hc.Host, link: Link, name: str, kind: str, dirty_mib: int,
               commute: bool = False) -> dict[str, Any]:
    """``virsh migrate --live --copy-storage-inc`` with ``kind``: ``zstd`` (multifd, 2 connections, zstd, and
    auto-converge as Capsule's live move has) or ``postcopy`` (``--postcopy-after-precopy``: one pre-copy pass,
    then post-copy). ``commute``: B holds yesterday's version (libvirt cannot use it)."""
    digest = prepare(a, name, dirty_mib, commute, b)
    dom = a.domain(name)
    xml = a.sh(f"virsh -c qemu:///system dumpxml --migratable {dom}")
    found = re.search(r"<source file='([^']+)'", xml)
    assert found is not None, "the domain has no file disk"
    leaf = found.group(1)
    info = json.loads(a.sh(f"qemu-img info -U --output=json {leaf}"))
    # B's top layer precreated over B's own copy of the image's layer, in an instance directory made as Capsule
    # makes one (the agent's user, QEMU's group, 01770), as Capsule's own incoming live move does
    b_dir = f"{b.home}/instances/{name}"
    b_leaf = f"{b_dir}/leaf.qcow2"
    backing = os.path.join(os.path.dirname(leaf), info["backing-filename"]).replace(a.home, b.home)
    b_xml = xml.replace(leaf, b_leaf).replace(a.home, b.home)
    _write(a, f"/tmp/{name}.xml", b_xml)
    b.sh(f"install -d -o capsule -g libvirt-qemu -m 1770 {b_dir} && qemu-img create -q -f qcow2 -F qcow2 "
         f"-b {backing} {b_leaf} {info['virtual-size']}")
    # what QEMU opens there made its, as Capsule does before it starts a guest (capsule.runtime.guestaccess)
    opened = sorted(set(re.findall(rf"({re.escape(b.home)}/[^<'\"]+)", b_xml)) - {b_leaf} | {backing})
    b._exec(["/opt/capsule/.venv/bin/python", "-c", _LEND, b.home, b_leaf, *opened])
    flags = ["--live", "--copy-storage-inc", "--xml", f"/tmp/{name}.xml",
             "--migrateuri", f"tcp://127.0.0.1:{link.migration}", "--listen-address", link.far,
             "--disks-port", str(link.nbd)]
    if kind == "zstd":
        flags += ["--parallel", "--parallel-connections", "2", "--compressed", "--comp-methods", "zstd",
                  "--auto-converge"]
    elif kind == "postcopy":
        flags += ["--postcopy", "--postcopy-after-precopy"]
    before_clock = a.domain_offset(dom)
    before = link.link.wire_bytes()
    t = time.monotonic()
    a.sh(" ".join([*VIRSH, "migrate", *flags, dom, f"qemu+tcp://127.0.0.1:{link.libvirt}/system"]), timeout=3600)
    seconds = time.monotonic() - t
    wire = link.link.wire_bytes() - before
    after_clock = b.domain_offset(dom)
    stats = parse_rawstats(b.sh(f"virsh -c qemu:///system domjobinfo --completed --rawstats {dom}"))
    moved = _by_domain(b, dom, GUEST.check).split()[0]
    b.sh(f"virsh -c qemu:///system destroy {dom}; rm -rf {b_dir}")
    paused, error = guestclock.paused(before_clock, after_clock)
    return {"case": {"zstd": "virsh --live multifd+zstd", "postcopy": "virsh --postcopy-after-precopy"}[kind]
            + (", commute" if commute else ""),
            "seconds": round(seconds, 2), "wire_bytes": wire, "content_intact": moved == digest,
            "paused_ms": round(paused * 1000), "paused_error_ms": round(error * 1000),
            **job_figures(stats), "raw": stats}


# Run on host A: what `capsule migrate` calls (capsule.migrate.migrate): live, or offline (mode full)
_CAPSULE_MIGRATE = """
import json, os, sys
from pathlib import Path
from capsule import migrate
from capsule.store import Store
live = sys.argv[3] in ("live", "postcopy")
r = migrate.migrate(Store.open(Path(os.environ["CAPSULE_HOME"])), sys.argv[1], sys.argv[2],
                    os.environ["CAPSULE_TOKEN"], mode="full", live=live, postcopy=sys.argv[3] == "postcopy")
print(json.dumps({"seconds": r.seconds, "push": r.push.as_dict() if r.push else None,
                  "live": r.live.as_dict() if r.live is not None else None}))
"""


def capsule_move(a: hc.Host, b: hc.Host, link: Link, name: str, kind: str, dirty_mib: int,
                 commute: bool = False) -> dict[str, Any]:
    """``capsule migrate`` (``kind`` live: the default; postcopy: ``--postcopy``; offline: ``--offline``).
    ``commute``: B holds yesterday's version of the capsule."""
    digest = prepare(a, name, dirty_mib, commute, b)
    before_clock = a.guest_offset(name)
    before = link.link.wire_bytes()
    t = time.monotonic()
    out = a._exec(["/opt/capsule/.venv/bin/python", "-c", _CAPSULE_MIGRATE, name,
                   f"http://127.0.0.1:{link.agent}", kind], env={"CAPSULE_TOKEN": b.token}, timeout=3600).stdout
    seconds = time.monotonic() - t
    wire = link.link.wire_bytes() - before
    after_clock = b.guest_offset(name)
    r = json.loads(out.strip().splitlines()[-1])
    moved = b.guest(name, GUEST.check).split()[0]
    b.capsule("stop", name, "--force")
    paused, error = guestclock.paused(before_clock, after_clock)
    live = r.get("live") or {}
    return {"case": "capsule migrate" + {"live": "", "offline": " --offline", "postcopy": " --postcopy"}[kind]
            + (", commute" if commute else ""),
            "seconds": round(seconds, 2), "wire_bytes": wire, "content_intact": moved == digest,
            "paused_ms": round(paused * 1000), "paused_error_ms": round(error * 1000),
            "downtime_ms": live.get("pause_ms"), "memory_processed_bytes": live.get("memory_bytes"),
            "memory_wire_bytes": live.get("memory_wire_bytes"), "memory_refs": live.get("memory_refs"),
            "memory_iterations": live.get("rounds"), "postcopy": live.get("postcopy"),
            "switchover_rate": live.get("switchover_rate"), "switchover": live.get("switchover"),
            "disks_raw_bytes": live.get("disks_raw_bytes"), "disks_wire_bytes": live.get("disks_wire_bytes"),
            "hcp_wire_bytes": (r["push"] or {}).get("wire_bytes"), "raw": r}


CASES = {"virsh-zstd": (virsh_move, "zstd"), "virsh-postcopy": (virsh_move, "postcopy"),
         "capsule": (capsule_move, "live"), "capsule-postcopy": (capsule_move, "postcopy"),
         "capsule-offline": (capsule_move, "offline")}
# the commute case: B holds yesterday's version of the capsule (prepare's ``commute``)
COMMUTE = {"virsh-zstd-commute": (virsh_move, "zstd"), "capsule-commute": (capsule_move, "live"),
           "capsule-offline-commute": (capsule_move, "offline")}
