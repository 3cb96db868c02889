"""B4, scheduled backups of a working desktop (Collective §5.4, Fig. 8): what each snapshot costs.

A Debian guest runs a scripted office day (bench/office_workload.py: edits documents, rebuilds a small
Python project, browses a local web server with a disk and a memory cache). Every minute Capsule's backup
job runs (``capsule backup run``: a memory snapshot, ballooned first with the ``cache`` policy, then
``--to`` a backup host: a second store's agent that holds the previous snapshots). Snapshot 0 is taken
half a minute after the workload starts (the first, full backup); snapshots 1..N are the increments.

Per snapshot, for the disk and the memory:
- raw: the blocks the disk leaf holds (what the guest wrote that minute) / the memory image's size;
- after hashing: distinct non-zero 4 KiB blocks whose content is in nothing before (the image, earlier
  snapshots, this snapshot's memory: bench/backup_accounting.py);
- after hashing + zstd -3 (and + gzip -6, the paper's measure): those blocks compressed as one stream;
- HCP wire bytes of the push to the backup host (its per-object report);
- the pause the guest felt: save + seal + restore (the balloon runs while the guest does).

Peers on the same series: libvirt incremental backup (a checkpoint's dirty bitmap, ``virsh backup-begin``
with ``<incremental>``: bench/backup_peers.py) of the same domain each minute, and borg (zstd,3) backing up
the raw disk and the memory image of each snapshot, repository growth. Paper: memory 6–17 MB and disk
2–22 MB per snapshot after gzip.

    .venv/bin/python bench/backup_series.py [--minutes 12] [--memory 512M]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import backup_peers  # noqa: E402
from bench.backup_accounting import Seen, compressed_sizes  # noqa: E402
from bench.common import RESULTS, image_stores, table, workdir, write_result  # noqa: E402
from capsule import capsules, hosts, lifecycle, qemuimg, transfer  # noqa: E402
from capsule.agent.launch import AgentProcess  # noqa: E402
from capsule.backup import jobs, runner  # noqa: E402
from capsule.backup.retention import Policy  # noqa: E402
from capsule.console.serial import ConsoleSession  # noqa: E402
from capsule.runtime.guestagent import GuestAgent, wait_for_agent  # noqa: E402
from capsule.store import Store  # noqa: E402
from capsule.store.objectio import BlockReader  # noqa: E402
from testkit.images import destroy_domains  # noqa: E402

NAME = "office"
HOST = "vault"
MB = 1e6
PAPER_MB = {"memory": (6, 17), "disk": (2, 22)}
WORKLOAD = Path(__file__).resolve().parent / "office_workload.py"


class Recorder:
    """Keeps the report of every HCP push (the backup job's copies call ``transfer.push``), and the
    details of every snapshot the job takes (``take``: the job's memory snapshot, ballooned)."""

    def __init__(self) -> None:
        self.pushes: list[transfer.TransferReport] = []
        self.sealed: list[dict[str, Any]] = []
        self._push = transfer.push

    def push(self, *args: Any, **kwargs: Any) -> transfer.TransferReport:
        report = self._push(*args, **kwargs)
        self.pushes.append(report)
        return report

    def take(self, store: Store, name: str, mode: str, say: runner.Say) -> runner.Taken:
        t0 = time.monotonic()
        sealed, resumed = lifecycle.snapshot(store, name, balloon="cache", note=jobs.backup_note(mode, "memory"),
                                             say=say)
        total = time.monotonic() - t0
        assert sealed.version is not None
        balloon = sealed.balloon
        self.sealed.append({"balloon_seconds": round(balloon.seconds, 2) if balloon else 0.0,
                            "balloon_held_bytes": balloon.held_bytes if balloon else 0,
                            "save_seconds": round(sealed.save_seconds, 2),
                            "seal_seconds": round(sealed.seal_seconds, 2),
                            "restore_seconds": round(resumed.seconds, 2),
                            "pause_seconds": round(sealed.save_seconds + sealed.seal_seconds + resumed.seconds, 2),
                            "snapshot_seconds": round(total, 2)})
        nbytes = sum(x.stored_bytes for x in sealed.layers) + (sealed.memory.stored_bytes if sealed.memory else 0)
        return runner.Taken(sealed.version, nbytes, self.sealed[-1]["pause_seconds"], "memory")


def start_workload(store: Store) -> None:
    with GuestAgent(store.instance_dir(NAME) / "agent.sock", timeout=30) as agent:
        agent.exec(["sh", "-c", "cat > /root/office_workload.py"], stdin=WORKLOAD.read_text())
    with ConsoleSession(store.domain_name(NAME)) as c:
        c.run("nohup setsid python3 /root/office_workload.py >/root/office.log 2>&1 < /dev/null & sleep 1")


def run_series(a: Store, work: Path, minutes: int, rec: Recorder, libvirt: bool) -> list[dict[str, Any]]:
    lv = backup_peers.LibvirtIncremental(work / "libvirt") if libvirt else None
    rows: list[dict[str, Any]] = []
    t_start = time.monotonic() + 30
    for i in range(minutes + 1):
        time.sleep(max(0.0, t_start + 60 * i - time.monotonic()))
        dom = a.domain_name(NAME)
        inc = lv.increment(dom) if lv is not None and i > 0 else None
        res = runner.run(a, NAME, take=rec.take)
        if not res.ok:
            raise RuntimeError(f"backup run {i} failed: {res.error}")
        if lv is not None:
            lv.start(a.domain_name(NAME))
        push = rec.pushes[-1]
        wire = {"memory": 0, "disk": 0}
        for obj in push.objects:
            wire["memory" if obj.role == "memory" else "disk"] += obj.wire_bytes
        row = {"snapshot": i, "version": res.version, "at_seconds": round(time.monotonic() - t_start, 1),
               **rec.sealed[-1], "hcp_wire_memory_bytes": wire["memory"], "hcp_wire_disk_bytes": wire["disk"],
               "hcp_wire_bytes": push.wire_bytes, "libvirt_increment": inc}
        rows.append(row)
        print(f"snapshot {i} (v{res.version}): pause {row['pause_seconds']} s, HCP wire "
              f"{push.wire_bytes / MB:.1f} MB" + (f", libvirt increment {inc['bytes'] / MB:.1f} MB" if inc else ""),
              flush=True)
    return rows


def _blocks(store: Store, kind: str, oid: str, indices: list[int], batch: int = 256):
    with BlockReader(store, kind, oid) as reader:
        for k in range(0, len(indices), batch):
            yield b"".join(reader.read(indices[k:k + batch]))


def account(a: Store, rows: list[dict[str, Any]]) -> None:
    """Add raw / after hashing / + zstd / + gzip bytes of disk and memory to each row."""
    cat = a.catalogue
    seen = Seen()
    image = cat.image("debian")
    assert image is not None   # (the capsule was made from it)
    layer: str | None = image.root_layer
    while layer is not None:                      # the image the capsule started from is known to both
        seen.add_known(a.layer_manifest(layer).records())
        lrow = cat.layer(layer)
        layer = lrow.parent if lrow else None
    previous: set[str] = set()
    for row in rows:
        v = cat.version(NAME, row["version"])
        assert v is not None and v.memory is not None
        memory = cat.file(v.memory)
        assert memory is not None   # (a version's objects are in its store)
        m = a.file_manifest(v.memory)
        new = seen.take("memory", m.records())
        mem = compressed_sizes(_blocks(a, "file", v.memory, new.indices))
        row.update({"memory_raw_bytes": memory.size, "memory_nonzero_bytes": m.nonzero_blocks * 4096,
                    "memory_hashed_bytes": new.nbytes, "memory_hashed_zstd_bytes": mem.zstd,
                    "memory_hashed_gzip_bytes": mem.gzip})
        disk_raw = disk_hashed = disk_zstd = disk_gzip = 0
        tops = {c[-1] for c in v.chains}
        for top in sorted(tops - previous):
            lm = a.layer_manifest(top)
            disk_raw += len(lm) * 4096
            nd = seen.take("disk", lm.records())
            c = compressed_sizes(_blocks(a, "layer", top, nd.indices))
            disk_hashed, disk_zstd, disk_gzip = disk_hashed + nd.nbytes, disk_zstd + c.zstd, disk_gzip + c.gzip
        previous |= tops
        row.update({"disk_raw_bytes": disk_raw, "disk_hashed_bytes": disk_hashed, "disk_hashed_zstd_bytes": disk_zstd,
                    "disk_hashed_gzip_bytes": disk_gzip, "disk_top_layers": sorted(tops)})


def borg_peer(a: Store, work: Path, rows: list[dict[str, Any]]) -> None:
    """borg of each snapshot's whole raw disk and its memory image, two repositories: growth per archive."""
    raw = work / "raw"
    raw.mkdir()
    disk_repo = backup_peers.Borg(work / "borg-disk", work / "borg-base")
    mem_repo = backup_peers.Borg(work / "borg-memory", work / "borg-base")
    for row in rows:
        v = a.catalogue.version(NAME, row["version"])
        assert v is not None and v.memory is not None
        disk, memory = raw / "disk.raw", raw / "memory.img"
        qemuimg.flatten_to_raw(a.layer_path(v.chains[0][-1]), disk)
        os.link(a.file_path(v.memory), memory)
        row["borg_disk"] = disk_repo.backup([disk])
        row["borg_memory"] = mem_repo.backup([memory])
        disk.unlink()
        memory.unlink()
        print(f"borg {row['snapshot']}: disk +{row['borg_disk']['growth_bytes'] / MB:.1f} MB, memory "
              f"+{row['borg_memory']['growth_bytes'] / MB:.1f} MB", flush=True)


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    out = []
    for r in rows:
        val: Any = r
        for part in key.split("."):
            val = val.get(part) if isinstance(val, dict) else None
        out.append((val or 0) / MB)
    return out


COLUMNS = {   # label: (disk key, memory key)
    "raw": ("disk_raw_bytes", "memory_raw_bytes"),
    "after hashing": ("disk_hashed_bytes", "memory_hashed_bytes"),
    "hashing + zstd -3": ("disk_hashed_zstd_bytes", "memory_hashed_zstd_bytes"),
    "hashing + gzip -6": ("disk_hashed_gzip_bytes", "memory_hashed_gzip_bytes"),
    "HCP wire": ("hcp_wire_disk_bytes", "hcp_wire_memory_bytes"),
    "libvirt incremental": ("libvirt_increment.bytes", None),
    "libvirt incremental + zstd": ("libvirt_increment.zstd_bytes", None),
    "borg (zstd,3) growth": ("borg_disk.growth_bytes", "borg_memory.growth_bytes"),
}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max in MB over the increments (snapshots 1..N) of each column, disk and memory."""
    inc = [r for r in rows if r["snapshot"] > 0]
    out: dict[str, Any] = {}
    for label, keys in COLUMNS.items():
        for kind, key in zip(("disk", "memory"), keys, strict=True):
            if key is None or not inc:
                continue
            xs = _series(inc, key)
            out[f"{kind}: {label}"] = {"median_mb": round(statistics.median(xs), 2), "min_mb": round(min(xs), 2),
                                       "max_mb": round(max(xs), 2)}
    pauses = [r["pause_seconds"] for r in inc]
    if pauses:
        out["pause_seconds"] = {"median": statistics.median(pauses), "min": min(pauses), "max": max(pauses)}
    return out


def chart(rows: list[dict[str, Any]], path: Path, minutes: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inc = [r for r in rows if r["snapshot"] > 0]
    xs = [r["snapshot"] for r in inc]
    shown = {"after hashing": "tab:blue", "hashing + zstd -3": "tab:orange", "HCP wire": "tab:green",
             "libvirt incremental": "tab:red", "libvirt incremental + zstd": "tab:pink",
             "borg (zstd,3) growth": "tab:purple"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.6), sharey=True)
    for ax, kind, col in zip(axes, ("disk", "memory"), (0, 1), strict=True):
        labels = [(s, key) for s in shown if (key := COLUMNS[s][col]) is not None]
        width = 0.8 / len(labels)
        lo, hi = PAPER_MB[kind]
        ax.axhspan(lo, hi, color="grey", alpha=0.2, zorder=0, label=f"paper, gzip ({lo}–{hi} MB)")
        for k, (label, key) in enumerate(labels):
            ys = [max(y, 1e-3) for y in _series(inc, key)]
            ax.bar([x - 0.4 + width * (k + 0.5) for x in xs], ys, width, label=label, color=shown[label], zorder=2)
        ax.set_yscale("log")
        ax.set_title(f"{kind}, per snapshot")
        ax.set_xlabel("snapshot (one a minute)")
        ax.set_xticks(xs)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    axes[0].set_ylabel("MB (log)")
    fig.suptitle(f"B4: backups of a working desktop, one a minute for {minutes} min")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=int, default=12, help="snapshots after the first (one a minute)")
    ap.add_argument("--memory", default="512M", help="the guest's memory")
    ap.add_argument("--no-libvirt", action="store_true", help="leave out the libvirt incremental backup peer")
    ap.add_argument("--no-borg", action="store_true", help="leave out the borg peer")
    ap.add_argument("--replot", action="store_true", help="only draw the chart again from the JSON result")
    args = ap.parse_args()
    if args.replot:
        data = json.loads((RESULTS / "backup_series.json").read_text())
        chart(data["snapshots"], RESULTS / "backup_series.png", data["minutes"])
        print(f"→ {RESULTS / 'backup_series.png'}")
        return
    if not args.no_borg and shutil.which("borg") is None:
        sys.exit("the borg peer needs borg: apt-get install borgbackup (or give --no-borg)")
    work = workdir("capsule-b4-")
    agent: AgentProcess | None = None
    stores: list[Store] = []
    rec = Recorder()
    transfer.push = rec.push          # type: ignore[assignment]  # the copies' per-object reports
    try:
        # the backup host holds the image the capsule came from
        a, b = image_stores("debian", work / "a", work / "b")
        stores += [a, b]
        b.close()
        agent = AgentProcess(b.home, work / "b.token")
        hosts.add(a, HOST, agent.url, agent.token)
        capsules.create(a, NAME, "debian", memory=args.memory)
        lifecycle.start(a, NAME, timeout=300)
        wait_for_agent(a.instance_dir(NAME) / "agent.sock", timeout=120)
        start_workload(a)
        jobs.schedule(a, NAME, "minutely", Policy(last=1000), mode="memory", target=HOST)
        rows = run_series(a, work, args.minutes, rec, not args.no_libvirt)
        lifecycle.stop(a, NAME, force=True)
        account(a, rows)
        if not args.no_borg:
            borg_peer(a, work, rows)
        summ = summary(rows)
        png = RESULTS / "backup_series.png"
        RESULTS.mkdir(exist_ok=True)
        chart(rows, png, args.minutes)
        path = write_result("backup_series", {
            "minutes": args.minutes, "memory": args.memory, "balloon": "cache (virtio)",
            "libvirt": backup_peers.libvirt_version(), "borg": None if args.no_borg else backup_peers.borg_version(),
            "paper_mb_after_gzip": PAPER_MB, "summary": summ, "snapshots": rows, "chart": png.name,
            "note": "MB = 10^6 bytes; snapshot 0 is the first (full) backup, the summary is over 1..N; "
                    "libvirt incremental covers the disk only"})
        table("B4: per snapshot, median (min–max) MB over snapshots 1..N",
              ["", "disk", "memory"],
              [[label, *[_cell(summ.get(f"{k}: {label}")) for k in ("disk", "memory")]] for label in COLUMNS]
              + [["pause (s)", _cell_s(summ.get("pause_seconds")), ""]])
        print(f"→ {path}\n→ {png}")
    finally:
        transfer.push = rec._push         # type: ignore[assignment]
        if agent is not None:
            agent.stop()
        for s in stores:
            destroy_domains(s)
        shutil.rmtree(work, ignore_errors=True)


def _cell(s: dict[str, float] | None) -> str:
    return "—" if s is None else f"{s['median_mb']:.1f} ({s['min_mb']:.1f}–{s['max_mb']:.1f})"


def _cell_s(s: dict[str, float] | None) -> str:
    return "—" if s is None else f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})"


if __name__ == "__main__":
    main()
