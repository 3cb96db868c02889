"""B5, Capsule's encrypted S3 repository against restic: one SeaweedFS cluster, the same data, three ways.

A series of snapshots of one running guest (the tiny test guest: a busybox shell on a 64 MiB disk; the
desktop series of B4 takes too long on a small machine): snapshot 0 a minute after boot, then, before each
further snapshot, the guest writes ``--disk-mib`` of random data to its disk (a new place each time), a
``--memory-mib`` random file into its RAM-backed /tmp (dropping the one of two steps before), while a
counter ticks. Each snapshot (``capsule snapshot``: the memory image and the disk's new layer) is stored:

- Capsule's repository (``capsule repo push`` to ``s3+http://…/BUCKET/capsule``, format 2): only the 4 KiB
  blocks the repository lacks, up to 16 neighbours compressed (zstd) and sealed (AES-256-GCM) together as one
  blob, in packs of a few MiB;
- restic 0.14 (Debian's; repository format 2, compression ``auto``) to ``s3:…/BUCKET/restic`` on the same
  S3 gateway, backing up the same disk (flattened to a raw image, as a restic user would see it) and the
  same files (the memory image, the kernel and the initrd a Capsule version holds), one ``restic backup``
  per snapshot, its parent the one before;
- Capsule's host-to-host copy of today (HCP, ``capsule push`` to a backup host's agent on loopback), stored
  as the backup host's qcow2 layers and memory files (it holds the image the capsule came from — its disk
  layers, kernel and initrd — already, so its first copy sends less than the two repositories' first).

Figures per snapshot (bytes; times taken on a shared, loaded machine and only indicative):
- ``bucket growth``: how much the sum of object sizes under each repository's prefix grew (read with
  Capsule's S3 client: what the object store holds, keys, indexes, locks and all);
- ``uploaded``: Capsule's own push figure (every request body sent: packs, index, manifests, record, lock);
  restic's ``--json`` summary ``data_added`` (restic 0.14 counts the new blobs before compression);
  HCP's wire bytes;
- ``stored`` (HCP): the allocated size of the objects (and their manifests) the copy added on the backup
  host;
- the time each store took (restic's excludes flattening the disk, which is shown apart; Capsule's block
  hashes are made when the snapshot is sealed, which ``snapshot_seconds`` holds);
- ``blob_overhead_bytes`` (Capsule): what its new 4 KiB blocks cost beside their compressed bytes (seals,
  codec byte, pack-header and index entries), to read the first, full snapshot's figure by; ``by_folder``
  (both repositories): the bucket's bytes after the snapshot by the folder below the prefix.

Table columns: ``+MB`` bucket (or backup host) growth, ``up``/``added``/``wire`` the uploaded figures above,
``s`` seconds; the last row: the buckets' bytes after the last snapshot and the sums of the rest.

Then ten capsules derived from one image (``--ten-image``, default the Debian test image), each given
``--ten-mib`` of its own random writes host-side (a new qcow2 leaf over the image written with
``qemu-io``, sealed as a layer and recorded as the capsule's version 2; no guest boots), are pushed into one
repository; the bytes it holds are set against a repository holding one of them. Goal: ≤ 1.3 × one.

    .venv/bin/python bench/repo_vs_restic.py [--snapshots 6] [--disk-mib 2] [--memory-mib 4]
        [--ten-image debian] [--ten-mib 4] [--no-ten]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS, image_stores, table, workdir, write_result  # noqa: E402
from capsule import capsules, hosts, lifecycle, qemuimg, transfer  # noqa: E402
from capsule.agent.launch import AgentProcess  # noqa: E402
from capsule.console.serial import ConsoleSession  # noqa: E402
from capsule.repo.push import push as repo_push  # noqa: E402
from capsule.repo.repository import Repository  # noqa: E402
from capsule.repo.s3 import Credentials, S3Client, parse_url  # noqa: E402
from capsule.store import Store  # noqa: E402
from capsule.store.catalogue import VersionRow  # noqa: E402
from capsule.transfer.records import objects_of, version_record  # noqa: E402
from testkit.images import destroy_domains  # noqa: E402
from testkit.seaweedfs import SeaweedCluster  # noqa: E402

NAME = "series"
HOST = "vault"
BUCKET = "bench-b5"
PASS = b"b5 benchmark passphrase"
MB = 1e6
GOAL_TEN = 1.3
# what new blocks cost the repository beside their (compressed) bytes (block ids are random: the index's zstd
# cannot shrink them). Format 2: per blob the seal (magic, nonce, tag), the codec byte and its place in the
# pack's header and in the session's index; per block its id in both. Format 1: 113 bytes a block.
BLOB_OVERHEAD = 4 + 12 + 16 + 1 + 10 + 10
BLOCK_OVERHEAD = 32 + 32
COUNTER = "(i=0; : > /tmp/count; while true; do i=$((i+1)); echo $i 1<> /tmp/count; sleep 0.5; done) >/dev/null 2>&1 &"


def bucket_bytes(client: S3Client, prefix: str) -> tuple[int, int]:
    """(bytes, objects) under ``prefix/`` in the client's bucket: the sum of the listed object sizes."""
    folders = bucket_folders(client, prefix)
    return sum(folders.values()), sum(1 for _ in client.list(prefix.rstrip("/") + "/"))


def bucket_folders(client: S3Client, prefix: str) -> dict[str, int]:
    """Bytes under ``prefix/`` by the folder below it (packs, index, manifests, versions, keys, data …)."""
    out: dict[str, int] = {}
    cut = len(prefix.rstrip("/")) + 1
    for key, size in client.list(prefix.rstrip("/") + "/"):
        folder = key[cut:].split("/", 1)[0]
        out[folder] = out.get(folder, 0) + size
    return out


class Restic:
    """One restic repository on the S3 gateway (its own cache directory, a fixed password)."""

    def __init__(self, cluster: SeaweedCluster, prefix: str, work: Path) -> None:
        self.repo = f"s3:{cluster.endpoint}/{BUCKET}/{prefix}"
        self.env = {**os.environ, **cluster.env(), "RESTIC_PASSWORD": PASS.decode(),
                    "RESTIC_CACHE_DIR": str(work / "restic-cache"), "AWS_DEFAULT_REGION": "us-east-1"}
        self._run("init")

    def _run(self, *args: str) -> str:
        r = subprocess.run(["restic", "-r", self.repo, *args], capture_output=True, text=True, env=self.env)
        if r.returncode != 0:
            raise RuntimeError(f"restic {args[0]}: {r.stderr.strip()[-2000:]}")
        return r.stdout

    def backup(self, src: Path) -> dict[str, Any]:
        """``restic backup --json`` of ``src``; its summary's figures and the time it took."""
        t0 = time.monotonic()
        out = self._run("backup", "--json", "--host", "b5", str(src))
        seconds = time.monotonic() - t0
        summary = next(json.loads(line) for line in reversed(out.splitlines())
                       if line.startswith("{") and '"summary"' in line)
        return {"data_added": summary["data_added"], "files_changed": summary["files_changed"],
                "total_bytes_processed": summary["total_bytes_processed"], "seconds": round(seconds, 2)}


@contextmanager
def seaweed_workdir(prefix: str) -> Iterator[tuple[Path, SeaweedCluster]]:
    """A work directory and a SeaweedFS cluster started in it; both removed at the end."""
    work = workdir(prefix)
    cluster = SeaweedCluster(work / "seaweedfs")
    try:
        cluster.start()
        yield work, cluster
    finally:
        cluster.remove()
        shutil.rmtree(work, ignore_errors=True)


def restic_version() -> str:
    return subprocess.run(["restic", "version"], check=True, capture_output=True, text=True).stdout.strip()


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512 if path.exists() else 0


def host_stored(b: Store, version: VersionRow, seen: set[str]) -> int:
    """Allocated bytes of the version's layers and memory file (with manifests) on the backup host that no
    earlier copy brought; adds them to ``seen``."""
    total = 0
    for chain in version.chains:
        for lid in chain:
            if lid not in seen:
                seen.add(lid)
                total += allocated(b.layer_path(lid)) + allocated(b.layer_manifest_path(lid))
    if version.memory and version.memory not in seen:
        seen.add(version.memory)
        total += allocated(b.file_path(version.memory)) + allocated(b.file_manifest_path(version.memory))
    return total


def step(i: int, disk_mib: int, memory_mib: int) -> str:
    """The guest's writes before snapshot ``i``: new random disk blocks past the patterned 4 MiB, a new
    random file in /tmp (RAM), the one of two steps before removed."""
    blocks = disk_mib * 256
    return (f"dd if=/dev/urandom of=/dev/vda bs=4096 seek={1024 + (i - 1) * blocks} count={blocks} conv=notrunc "
            f"2>/dev/null; dd if=/dev/urandom of=/tmp/m{i} bs=1048576 count={memory_mib} 2>/dev/null; "
            f"rm -f /tmp/m{i - 2}; sync; echo ok")


@dataclass
class ThreeWays:
    """Where each snapshot of a series is stored: Capsule's repository (``client``'s prefix ``capsule``),
    restic (prefix ``restic``, fed from ``src``), and HCP to the backup host ``b`` behind ``agent``."""

    client: S3Client
    repo: Repository
    restic: Restic
    src: Path
    agent: AgentProcess
    b: Store
    seen: set[str] = field(default_factory=set)

    @classmethod
    def make(cls, cluster: SeaweedCluster, work: Path, agent: AgentProcess, b: Store) -> ThreeWays:
        client = S3Client(parse_url(cluster.url(BUCKET, "capsule")), Credentials(cluster.access_key,
                                                                                cluster.secret_key))
        src = work / "restic-src"
        src.mkdir()
        return cls(client, Repository.init(client, PASS), Restic(cluster, "restic", work), src, agent, b)

    def store(self, a: Store, v: VersionRow) -> dict[str, Any]:
        """Store version ``v`` of ``a`` three ways; each way's figures."""
        client = self.client
        row: dict[str, Any] = {}
        before, _ = bucket_bytes(client, "capsule")
        rep = repo_push(a, v.ref, self.repo)
        after, objects = bucket_bytes(client, "capsule")
        row["capsule_repo"] = {"uploaded_bytes": rep.uploaded_bytes, "bucket_growth_bytes": after - before,
                               "bucket_bytes": after, "bucket_objects": objects, "blocks_new": rep.blocks_new,
                               "blocks_known": rep.blocks_known, "packs": rep.packs, "seconds": rep.seconds,
                               "blobs": rep.blobs,
                               "blob_overhead_bytes": rep.blobs * BLOB_OVERHEAD + rep.blocks_new * BLOCK_OVERHEAD,
                               "new_raw_bytes": rep.new_bytes, "by_folder": bucket_folders(client, "capsule")}
        # restic, the same disk (flattened) and memory image
        t1 = time.monotonic()
        for k, chain in enumerate(v.chains):
            disk = self.src / f"disk{k}.raw"
            disk.unlink(missing_ok=True)
            qemuimg.flatten_to_raw(a.layer_path(chain[-1]), disk)
        assert v.memory is not None
        for fid, role in objects_of(version_record(a, v))[1]:     # the memory image, kernel and initrd
            (self.src / role).unlink(missing_ok=True)
            os.link(a.file_path(fid), self.src / role)
        flatten = time.monotonic() - t1
        before, _ = bucket_bytes(client, "restic")
        res = self.restic.backup(self.src)
        after, objects = bucket_bytes(client, "restic")
        row["restic"] = {**res, "bucket_growth_bytes": after - before, "bucket_bytes": after,
                         "by_folder": bucket_folders(client, "restic"),
                         "bucket_objects": objects, "flatten_seconds": round(flatten, 2)}
        # HCP to the backup host
        hcp = transfer.push(a, v.ref, self.agent.url, self.agent.token)
        row["hcp"] = {"wire_bytes": hcp.wire_bytes, "stored_bytes": host_stored(self.b, v, self.seen),
                      "seconds": round(hcp.seconds, 2)}
        row["memory_image_bytes"] = a.file_path(v.memory).stat().st_size
        print(f"  capsule +{row['capsule_repo']['bucket_growth_bytes'] / MB:.2f} MB ({rep.seconds:.1f} s), "
              f"restic +{row['restic']['bucket_growth_bytes'] / MB:.2f} MB ({res['seconds']:.1f} s), HCP wire "
              f"{hcp.wire_bytes / MB:.2f} MB", flush=True)
        return row


@contextmanager
def source_and_ways(image: str, work: Path, cluster: SeaweedCluster) -> Iterator[tuple[Store, ThreeWays]]:
    """Store A holding ``image``, and the three ways its snapshots are stored (the backup host B, holding the
    image too, behind its own agent); A's guests destroyed and B's agent stopped at the end."""
    a, b = image_stores(image, work / "a", work / "b")
    agent: AgentProcess | None = None
    ways: ThreeWays | None = None
    try:
        b.close()
        agent = AgentProcess(b.home, work / "b.token")
        hosts.add(a, HOST, agent.url, agent.token)   # (b's object paths are read below, closed)
        ways = ThreeWays.make(cluster, work, agent, b)
        yield a, ways
    finally:
        if ways is not None:
            ways.client.close()
        if agent is not None:
            agent.stop()
        for s in (a, b):
            destroy_domains(s)


def run_series(args: argparse.Namespace, work: Path, cluster: SeaweedCluster) -> tuple[list[dict[str, Any]], Any]:
    with source_and_ways("tiny", work, cluster) as (a, ways):
        capsules.create(a, NAME, "tiny", memory=args.memory)
        lifecycle.start(a, NAME, timeout=300)
        with ConsoleSession(a.domain_name(NAME)) as c:
            c.run(COUNTER)
        time.sleep(args.settle)
        rows: list[dict[str, Any]] = []
        for i in range(args.snapshots + 1):
            if i > 0:
                with ConsoleSession(a.domain_name(NAME)) as c:
                    c.run(step(i, args.disk_mib, args.memory_mib), timeout=300)
            t0 = time.monotonic()
            sealed, _resumed = lifecycle.snapshot(a, NAME, note=f"b5 snapshot {i}")
            v = sealed.version
            assert v is not None
            print(f"snapshot {i}:", flush=True)
            rows.append({"snapshot": i, "version": v.number, "snapshot_seconds": round(time.monotonic() - t0, 2),
                         **ways.store(a, v)})
        lifecycle.stop(a, NAME, force=True)
        return rows, {"capsule_repo_objects": bucket_bytes(ways.client, "capsule")[1]}


def derive_with_writes(store: Store, name: str, image: str, mib: int, seed: Path, k: int) -> VersionRow:
    """Capsule ``name`` from ``image``, then version 2: a leaf over the image's disk with ``mib`` MiB of
    random bytes (``seed``'s, at an offset of its own) written by qemu-io, sealed as a layer."""
    capsules.create(store, name, image)
    v = store.catalogue.latest_version(name)
    assert v is not None
    chain = v.chains[0]
    leaf = store.new_leaf_path()
    qemuimg.create_leaf(leaf, store.layer_path(chain[-1]))
    size = mib << 20
    disk = int(qemuimg.info(leaf)["virtual-size"])
    offset = disk // 2 + k * size         # each capsule a place of its own, past the image's first half
    if offset + size > disk:
        raise SystemExit(f"--ten-mib {mib}: ten such writes do not fit in the second half of the image's disk")
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -q -s {seed / f'w{k}'} {offset} {size}",
                    str(leaf)], check=True, capture_output=True)
    row = store.seal_layer(leaf, chain[-1])
    chains = [[*chain, row.id], *v.chains[1:]]
    with store.catalogue.transaction():
        store.catalogue.add_layer(row)
        version = VersionRow(name, v.number + 1, name, v.number, None, chains, v.config, "b5 writes", time.time())
        store.catalogue.add_version(version)
    return version


def run_ten(args: argparse.Namespace, work: Path, cluster: SeaweedCluster) -> dict[str, Any]:
    [store] = image_stores(args.ten_image, work / "ten")
    seed = work / "seed"
    seed.mkdir()
    for k in range(10):
        (seed / f"w{k}").write_bytes(os.urandom(args.ten_mib << 20))
    versions = [derive_with_writes(store, f"d{k}", args.ten_image, args.ten_mib, seed, k) for k in range(10)]
    creds = Credentials(cluster.access_key, cluster.secret_key)
    out: dict[str, Any] = {"image": args.ten_image, "divergent_mib_each": args.ten_mib}
    for prefix, refs in (("one", versions[:1]), ("ten", versions)):
        client = S3Client(parse_url(cluster.url(BUCKET, prefix)), creds)
        try:
            repo = Repository.init(client, PASS)
            reports = [repo_push(store, v.ref, repo) for v in refs]
            stored, objects = bucket_bytes(client, prefix)
        finally:
            client.close()
        out[prefix] = {"capsules": len(refs), "bucket_bytes": stored, "bucket_objects": objects,
                       "uploaded_bytes": sum(r.uploaded_bytes for r in reports),
                       "seconds": [r.seconds for r in reports]}
        print(f"{prefix}: {stored / MB:.1f} MB in the bucket", flush=True)
    out["ten_times_one_bytes"] = 10 * out["one"]["bucket_bytes"]
    out["ratio_to_one"] = round(out["ten"]["bucket_bytes"] / out["one"]["bucket_bytes"], 3)
    out["goal"] = GOAL_TEN
    out["met"] = out["ratio_to_one"] <= GOAL_TEN
    return out


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def s(way: str, key: str) -> int:
        return sum(r[way][key] for r in rows)

    return {"capsule_repo": {"bucket_bytes": rows[-1]["capsule_repo"]["bucket_bytes"],
                             "uploaded_bytes": s("capsule_repo", "uploaded_bytes"),
                             "seconds": round(s("capsule_repo", "seconds"), 2)},
            "restic": {"bucket_bytes": rows[-1]["restic"]["bucket_bytes"], "data_added": s("restic", "data_added"),
                       "seconds": round(s("restic", "seconds"), 2)},
            "hcp": {"stored_bytes": s("hcp", "stored_bytes"), "wire_bytes": s("hcp", "wire_bytes"),
                    "seconds": round(s("hcp", "seconds"), 2)}}


def goals(rows: list[dict[str, Any]], tot: dict[str, Any]) -> dict[str, Any]:
    """Capsule's stored and uploaded bytes ≤ restic's, per snapshot and in total (uploaded: Capsule's own
    figure against the larger-is-fairer of restic's data_added and its bucket growth is not taken: restic's
    bucket growth is what it sent, so both are set against it)."""
    per = [{"snapshot": r["snapshot"],
            "stored": r["capsule_repo"]["bucket_growth_bytes"] <= r["restic"]["bucket_growth_bytes"],
            "uploaded": r["capsule_repo"]["uploaded_bytes"] <= r["restic"]["bucket_growth_bytes"]} for r in rows]
    return {"per_snapshot": per,
            "all_snapshots_stored": all(p["stored"] for p in per),
            "all_snapshots_uploaded": all(p["uploaded"] for p in per),
            "total_stored": tot["capsule_repo"]["bucket_bytes"] <= tot["restic"]["bucket_bytes"],
            "total_uploaded": tot["capsule_repo"]["uploaded_bytes"] <= tot["restic"]["bucket_bytes"]}


def _mb(x: float) -> str:
    return f"{x / MB:.2f}"


def print_tables(rows: list[dict[str, Any]], tot: dict[str, Any], ten: dict[str, Any] | None) -> None:
    if rows:
        series_table(rows, tot)
    if ten is not None:
        table(f"B5: ten capsules from {ten['image']}, {ten['divergent_mib_each']} MiB of own writes each",
              ["repository", "bucket MB", "uploaded MB", "× one"],
              [["one capsule", _mb(ten["one"]["bucket_bytes"]), _mb(ten["one"]["uploaded_bytes"]), "1.00"],
               ["ten × one capsule", _mb(ten["ten_times_one_bytes"]), "", "10.00"],
               ["ten capsules", _mb(ten["ten"]["bucket_bytes"]), _mb(ten["ten"]["uploaded_bytes"]),
                f"{ten['ratio_to_one']:.2f} (goal ≤ {GOAL_TEN})"]])


def series_table(rows: list[dict[str, Any]], tot: dict[str, Any]) -> None:
    table("B5: per snapshot, MB (10^6 bytes); seconds under load",
          ["snap", "capsule +MB", "up MB", "s", "restic +MB", "added MB", "s", "HCP +MB", "wire MB", "s"],
          [[r["snapshot"], _mb(r["capsule_repo"]["bucket_growth_bytes"]), _mb(r["capsule_repo"]["uploaded_bytes"]),
            f"{r['capsule_repo']['seconds']:.1f}", _mb(r["restic"]["bucket_growth_bytes"]),
            _mb(r["restic"]["data_added"]), f"{r['restic']['seconds']:.1f}", _mb(r["hcp"]["stored_bytes"]),
            _mb(r["hcp"]["wire_bytes"]), f"{r['hcp']['seconds']:.1f}"] for r in rows]
          + [["total", _mb(tot["capsule_repo"]["bucket_bytes"]), _mb(tot["capsule_repo"]["uploaded_bytes"]),
              f"{tot['capsule_repo']['seconds']:.1f}", _mb(tot["restic"]["bucket_bytes"]),
              _mb(tot["restic"]["data_added"]), f"{tot['restic']['seconds']:.1f}", _mb(tot["hcp"]["stored_bytes"]),
              _mb(tot["hcp"]["wire_bytes"]), f"{tot['hcp']['seconds']:.1f}"]])


def chart(result: dict[str, Any], path: Path) -> None:
    """B5's chart: what each store grew by per snapshot (left), and the ten capsules against one (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["series"]
    xs = [r["snapshot"] for r in rows]
    shown = [("Capsule repository (S3)", lambda r: r["capsule_repo"]["bucket_growth_bytes"], "tab:blue"),
             ("restic 0.14 (same S3)", lambda r: r["restic"]["bucket_growth_bytes"], "tab:red"),
             ("HCP to a backup host, on the wire", lambda r: r["hcp"]["wire_bytes"], "tab:green")]
    fig, (ax, ten_ax) = plt.subplots(1, 2, figsize=(13, 5.4), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(shown)
    for k, (label, value, colour) in enumerate(shown):
        ax.bar([x - 0.4 + width * (k + 0.5) for x in xs], [value(r) / 1e6 for r in rows], width, label=label,
               color=colour, zorder=2)
    ax.set_xticks(xs)
    ax.set_xlabel("snapshot (0: the first, full one)")
    ax.set_ylabel("MB stored (HCP: sent)")
    ax.set_title("stored per snapshot")
    ax.grid(axis="y", alpha=0.3, zorder=0)
    tot = result["totals"]
    ax.legend(title=f"the series: Capsule {tot['capsule_repo']['bucket_bytes'] / 1e6:.1f} MB, restic "
                    f"{tot['restic']['bucket_bytes'] / 1e6:.1f} MB", fontsize=8, title_fontsize=8)
    ten = result.get("ten_capsules")
    if ten:
        bars = [("one", ten["one"]["bucket_bytes"]), ("ten, one\nrepository", ten["ten"]["bucket_bytes"]),
                ("ten\ncopies", ten["ten_times_one_bytes"])]
        ten_ax.bar([b[0] for b in bars], [b[1] / 1e6 for b in bars], color=["tab:blue", "tab:blue", "tab:grey"],
                   zorder=2)
        ten_ax.axhline(ten["goal"] * ten["one"]["bucket_bytes"] / 1e6, color="black", ls="--", lw=1,
                       label=f"goal: {ten['goal']} × one")
        ten_ax.set_title(f"ten from one image: {ten['ratio_to_one']:.2f} × one", fontsize=10)
        ten_ax.set_ylabel("MB stored")
        ten_ax.grid(axis="y", alpha=0.3, zorder=0)
        ten_ax.legend(fontsize=8)
    else:
        ten_ax.axis("off")
    fig.suptitle("B5: the S3 repository against restic (one SeaweedFS cluster, the same data)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snapshots", type=int, default=6, help="snapshots after the first (default 6)")
    ap.add_argument("--memory", default="256M", help="the series guest's memory (default 256M)")
    ap.add_argument("--disk-mib", type=int, default=2, help="random MiB the guest writes to its disk per step")
    ap.add_argument("--memory-mib", type=int, default=4, help="random MiB the guest writes into /tmp per step")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds between boot and snapshot 0")
    ap.add_argument("--ten-image", default="debian", help="the image the ten capsules derive from")
    ap.add_argument("--ten-mib", type=int, default=4, help="random MiB each of the ten capsules writes")
    ap.add_argument("--no-ten", action="store_true", help="leave out the ten-capsule repository")
    ap.add_argument("--no-series", action="store_true", help="leave out the series (only the ten capsules)")
    ap.add_argument("--replot", action="store_true", help="only draw the chart again from the JSON result")
    args = ap.parse_args()
    png = RESULTS / "repo_vs_restic.png"
    if args.replot:
        chart(json.loads((RESULTS / "repo_vs_restic.json").read_text()), png)
        print(f"→ {png}")
        return
    if shutil.which("restic") is None and not args.no_series:
        sys.exit("the restic peer needs restic: apt-get install restic")
    with seaweed_workdir("capsule-b5-") as (work, cluster):
        rows, extra = run_series(args, work, cluster) if not args.no_series else ([], {})
        ten = None if args.no_ten else run_ten(args, work, cluster)
        tot = totals(rows) if rows else {}
        result = {"guest": "tiny (busybox, 64 MiB disk)", "memory": args.memory, "snapshots": args.snapshots,
                  "disk_mib_per_step": args.disk_mib, "memory_mib_per_step": args.memory_mib,
                  "restic": restic_version() if rows else None, "series": rows, "totals": tot, **extra,
                  "goals": goals(rows, tot) if rows else {}, "ten_capsules": ten,
                  "note": "bytes; MB = 10^6; times taken on a loaded 2-core machine; bucket figures are sums of "
                          "object sizes under each prefix (S3 list)"}
        if rows:
            chart(result, png)
            result["chart"] = png.name
        path = write_result("repo_vs_restic", result)
        print_tables(rows, tot, ten)
        if rows:
            print(json.dumps(result["goals"], indent=1))
        print(f"→ {path}")


if __name__ == "__main__":
    main()
