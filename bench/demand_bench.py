"""B3, demand-paged boot (§5.3, Fig. 7), first part: boot a remote inactive
Debian capsule on host B and report the time to the boot marker and the
bytes that crossed, for copy-first (pull, then boot) vs demand paging cold vs
demand paging with B's hash cache primed with a similar disk vs a second
boot, in the same run, on loopback agents. Also the disk server's own
figures (bench/diskserver_measure.py: cached throughput vs nbdkit's file
plugin, per-miss latency, read amplification).

With ``--rate-kbit N [--rtt-ms M]`` the source agent runs in network
namespace B and host B's commands in namespace A, joined by a link shaped
with tbf and a delaying proxy (testkit/netlink.py); 100000 is the LAN, 384
with 20 ms the paper's DSL. Shaped runs add the peers (bench/nbd_peers.py:
plain remote NBD, and QEMU copy-on-read over NBD) and count bytes on the
link itself; results are written after every case, and a case that does not
reach the marker within ``--case-timeout`` is reported as such.

    .venv/bin/python bench/demand_bench.py [--rate-kbit 100000 --rtt-ms 1]
    .venv/bin/python bench/demand_bench.py --rate-kbit 384 --rtt-ms 20 --case-timeout 1800
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS, table, workdir, write_result  # noqa: E402
from capsule import capsules, images, lifecycle, transfer  # noqa: E402
from capsule.agent.launch import AgentProcess  # noqa: E402
from capsule.lifecycle import demand  # noqa: E402
from capsule.store import Store  # noqa: E402
from testkit.images import IMAGE_HOME, destroy_domains  # noqa: E402


def fetched(store: Store, name: str) -> int:
    return json.loads((demand.shadow_dir(store) / f"{name}-disk0.stats.json").read_text())["source_bytes"]


CLI = [sys.executable, "-m", "capsule.cli.main"]

_DISK_STATS = ("guest_bytes", "source_bytes", "wire_bytes", "fetch_requests", "readahead_blocks", "cache_blocks",
               "miss_blocks", "miss_seconds")


def disk_server_stats(home: Path) -> dict:
    b = Store.open(home)
    try:
        stats = json.loads((demand.shadow_dir(b) / "deb-disk0.stats.json").read_text())
    except (OSError, ValueError):
        return {}
    finally:
        b.close()
    return {k: stats[k] for k in _DISK_STATS if k in stats}


def _link_breakdown(report: transfer.TransferReport, disk: dict) -> dict:
    """What crossed for a demand start, by part, against what the guest read: its disk's bytes (the disk
    server's guest_bytes), and those plus the kernel and initrd QEMU loads whole for the direct boot."""
    parts = {o.role: o for o in report.objects}
    out = {f"{role}_{k}": getattr(parts[role], f"{k}_bytes") for role in ("kernel", "initrd") if role in parts
           for k in ("raw", "wire")}
    objects_wire = sum(o.wire_bytes for o in report.objects)
    out["manifests_and_record_wire"] = report.wire_bytes - objects_wire
    out["disk_wire"] = disk.get("wire_bytes", 0)
    out["disk_guest_bytes"] = disk.get("guest_bytes", 0)
    link = report.wire_bytes + out["disk_wire"]
    out["link_bytes"] = link
    read = out["disk_guest_bytes"]
    whole = read + out.get("kernel_raw", 0) + out.get("initrd_raw", 0)
    out["link_vs_disk_read"] = round(link / read, 3) if read else None
    out["link_vs_disk_kernel_initrd_read"] = round(link / whole, 3) if whole else None
    return out


def _source(work: Path) -> tuple[Store, Store, str]:
    """(the test image store, host A holding a Debian capsule "deb", its root layer id)."""
    src = Store.open(IMAGE_HOME)
    images.build(src, "debian", "debian")
    a = Store.open(work / "a")
    images.import_image(src, a, "debian")
    capsules.create(a, "deb", "debian", memory="512M")
    image = a.catalogue.image("debian")
    assert image is not None   # (just imported)
    return src, a, image.root_layer


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-kbit", type=int, default=0, help="shape the link (0: plain loopback)")
    ap.add_argument("--rtt-ms", type=float, default=1.0)
    ap.add_argument("--case-timeout", type=float, default=3600.0,
                    help="seconds a case may take to reach the boot marker (shaped runs)")
    ap.add_argument("--cases", default=",".join(SHAPED_CASES),
                    help=f"shaped runs: which of {', '.join(SHAPED_CASES)} (demand: cold, second boot, primed)")
    ap.add_argument("--merge", action="store_true",
                    help="shaped runs: keep the JSON result's figures of the cases this run leaves out")
    args = ap.parse_args()
    if args.rate_kbit:
        cases = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = [c for c in cases if c not in SHAPED_CASES]
        if unknown:
            sys.exit(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(SHAPED_CASES)}")
        return shaped(args.rate_kbit, args.rtt_ms, args.case_timeout, cases, args.merge)
    work = workdir("capsule-b3-")
    stores: list[Store] = []
    agent = None
    try:
        _src, a, root = _source(work)
        stores.append(a)
        root_row = a.catalogue.layer(root)
        assert root_row is not None   # (the image's root layer)
        root_bytes = root_row.stored_bytes
        agent = AgentProcess(a.home, work / "a.token")
        rows, results = [], []

        def record(case: str, seconds: float, moved: int) -> None:
            results.append({"case": case, "seconds_to_marker": round(seconds, 2), "bytes_moved": moved})
            rows.append([case, f"{seconds:.1f}", f"{moved / 2**20:.1f}"])

        # copy-first: pull everything, then boot
        b = Store.open(work / "b-copy")
        stores.append(b)
        t = time.monotonic()
        pulled = transfer.pull(b, agent.url, "deb", agent.token)
        lifecycle.start(b, "deb", timeout=600)
        record("copy first", time.monotonic() - t, pulled.wire_bytes)
        lifecycle.stop(b, "deb", force=True)

        for case, primed in (("demand, cold", False), ("demand, primed cache", True)):
            b = Store.open(work / f"b-{'primed' if primed else 'cold'}")
            stores.append(b)
            if primed:  # a similar disk already on B: here the same image's root layer, elsewhere on disk
                (work / "other").mkdir(exist_ok=True)
                shutil.copyfile(a.layer_path(root), work / "other" / "similar.qcow2")
                b.hash_cache().prime_paths([work / "other"])
            t = time.monotonic()
            r = transfer.run(b, agent.url, "deb", agent.token)
            seconds = time.monotonic() - t
            lifecycle.stop(b, "deb", timeout=120)
            record(case, seconds, r.transfer.wire_bytes + fetched(b, "deb"))
            results[-1]["link"] = _link_breakdown(r.transfer, disk_server_stats(b.home))
            if not primed:
                t = time.monotonic()
                lifecycle.start(b, "deb", timeout=600)
                seconds = time.monotonic() - t
                lifecycle.stop(b, "deb", timeout=120)
                record("second boot (demand)", seconds, fetched(b, "deb"))
        micro = subprocess.run([sys.executable, str(ROOT / "bench" / "diskserver_measure.py")], capture_output=True,
                               text=True, timeout=900)
        try:
            micro_json = json.loads(micro.stdout)
        except ValueError:
            micro_json = {"error": (micro.stderr or micro.stdout)[-2000:]}
        path = write_result("demand_b3", {"root_layer_bytes": root_bytes, "results": results,
                                          "diskserver_micro": micro_json})
        table("B3: boot a remote Debian capsule (loopback)", ["case", "s to marker", "MiB moved"], rows)
        print(f"root layer holds {root_bytes / 2**20:.0f} MiB of data → {path}")
    finally:
        if agent:
            agent.stop()
        for s in stores:
            destroy_domains(s)
        shutil.rmtree(work, ignore_errors=True)


class CaseFailed(RuntimeError):
    """A command of one case failed (the bench goes on with the next case)."""


SHAPED_CASES = {"demand": ("demand, cold", "second boot (demand)", "demand, primed cache"),
                "nbd": ("plain NBD, no cache",), "cor": ("QEMU copy-on-read over NBD",), "copy": ("copy first",)}


def shaped(rate_kbit: int, rtt_ms: float, case_timeout: float, cases: list[str] | None = None,
           merge: bool = False) -> None:
    """The same cases with the source behind a shaped link, host B's commands in namespace A, and the
    plain-NBD peers; bytes are counted on the link itself (both directions, headers included)."""
    from bench.nbd_peers import NbdPeers
    from testkit.netlink import SlowLink

    work = workdir("capsule-b3-link-")
    stores: list[Store] = []
    name = f"demand_b3_{rate_kbit}kbit"
    try:
        _src, a, root = _source(work)
        stores.append(a)
        cases = cases or list(SHAPED_CASES)
        ours = {c for key in cases for c in SHAPED_CASES[key]}
        rows: list[list[str]] = []
        results: list[dict[str, Any]] = []

        def others() -> list[dict]:
            """With ``merge``, the other cases' figures in the JSON result as it is now (another run of other
            cases may be writing it too)."""
            if not merge or not (RESULTS / f"{name}.json").exists():
                return []
            return [r for r in json.loads((RESULTS / f"{name}.json").read_text())["results"] if r["case"] not in ours]

        with SlowLink(rate_kbit=rate_kbit, rtt_ms=rtt_ms) as link:
            # its log's tail is printed when a case fails
            url, pin = link.agent_b(work / "a", work / "a.token", log=work / "agent-a.log")
            env = dict(os.environ, CAPSULE_TOKEN=(work / "a.token").read_text().strip(), PYTHONPATH=str(ROOT))
            wait = ["--timeout", str(case_timeout)]

            def cli(home: Path, *argv: str) -> dict:
                r = link.exec_a([*CLI, "--home", str(home), *argv, "--json"], capture_output=True, text=True,
                                env=env, timeout=case_timeout + 600)
                if r.returncode != 0:
                    raise CaseFailed(f"{' '.join(argv)}: {r.stderr.strip()[-600:]}")
                return json.loads(r.stdout)

            def record(case: str, seconds: float | None, moved: int, home: Path | None = None) -> None:
                results.append({"case": case, "seconds_to_marker": None if seconds is None else round(seconds, 2),
                                "bytes_moved": moved})
                if home is not None:  # what the disk server saw: bytes the guest read vs bytes fetched
                    results[-1]["disk_server"] = disk_server_stats(home)
                rows.append([case, f"{seconds:.1f}" if seconds is not None else f"> {case_timeout:.0f}",
                             f"{moved / 2**20:.1f}"])
                write_result(name, {"rate_kbit": rate_kbit, "rtt_ms": rtt_ms, "bytes": "on the link, both ways",
                                    "results": others() + results})

            def timed(fn, *argv: str | Path) -> tuple[float | None, int]:  # noqa: ANN001
                """Seconds (None: failed or over the timeout, said on stderr) and bytes on the link."""
                before, t = link.wire_bytes(), time.monotonic()
                try:
                    fn(*argv)
                    seconds: float | None = time.monotonic() - t
                except (CaseFailed, subprocess.TimeoutExpired) as exc:
                    print(f"case failed: {exc}", file=sys.stderr)
                    tail = (work / "agent-a.log").read_bytes()[-3000:].decode(errors="replace")
                    print(f"the source agent's log ends:\n{tail}", file=sys.stderr)
                    seconds = None
                return seconds, link.wire_bytes() - before

            for case, primed in (("demand, cold", False), ("demand, primed cache", True)) if "demand" in cases else ():
                hb = work / f"b-{'primed' if primed else 'cold'}"
                if primed:
                    (work / "other").mkdir(exist_ok=True)
                    shutil.copyfile(work / "a" / "layers" / f"{root}.qcow2", work / "other" / "similar.qcow2")
                    b = Store.open(hb)
                    b.hash_cache().prime_paths([work / "other"])
                    b.close()
                seconds, moved = timed(cli, hb, "start", "deb", "--from", url, "--fingerprint", pin, *wait)
                with contextlib.suppress(CaseFailed):
                    cli(hb, "stop", "deb", "--force")
                record(case, seconds, moved, hb)
                if not primed and seconds is not None:
                    seconds, moved = timed(cli, hb, "start", "deb", *wait)
                    with contextlib.suppress(CaseFailed):
                        cli(hb, "stop", "deb", "--force")
                    record("second boot (demand)", seconds, moved)
            peered = [(c, cor) for key, c, cor in (("nbd", "plain NBD, no cache", False),
                                                  ("cor", "QEMU copy-on-read over NBD", True)) if key in cases]
            peers = NbdPeers(link, a, "deb", work) if peered else None
            for case, cor in peered:
                assert peers is not None   # (made when there are peered cases)
                seconds, moved = peers.boot(case, cor, case_timeout)
                record(case, seconds, moved)
            # last: on a slow link the longest case, and the one whose bytes are known in advance
            if "copy" in cases:
                hb = work / "b-copy"
                seconds, moved = timed(lambda: (cli(hb, "pull", "deb", "--from", url, "--fingerprint", pin),
                                                cli(hb, "start", "deb", *wait)))
                record("copy first", seconds, moved)
                with contextlib.suppress(CaseFailed):
                    cli(hb, "stop", "deb", "--force")
        table(f"B3: boot a remote Debian capsule over {rate_kbit} kbit/s, {rtt_ms:g} ms RTT",
              ["case", "s to marker", "MiB on the link"], rows)
        print(f"→ {RESULTS / (name + '.json')}")
    finally:
        for s in stores:
            destroy_domains(s)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
