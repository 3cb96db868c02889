"""B1's peers: what else an administrator could send to move a machine from the old disk to the new one.

- rsync -z of the new flattened raw image against the old one, through a real transport (a remote shell
  that is a local pipe, so rsync's delta algorithm and its compression both run, as over ssh): the bytes
  rsync reports sent.
- casync (desync's C original; a chunk store seeded with the old image): the compressed chunks of the new
  image's index that the seeded store lacks, plus the index itself.
- OSTree static delta between commits of the two root trees (extracted from the raw images with debugfs
  ``rdump``): the delta's size on disk.

The parsing and the goal checks are pure (unit-tested); the runners call the tools."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

_RSYNC_SENT = re.compile(r"^Total bytes sent:\s+([\d,]+)", re.M)
_RSYNC_LITERAL = re.compile(r"^Literal data:\s+([\d,]+)", re.M)


def rsync_stats(text: str) -> dict[str, int]:
    """Bytes sent and literal bytes from ``rsync --stats`` output (digits may hold thousands commas)."""
    sent, literal = _RSYNC_SENT.search(text), _RSYNC_LITERAL.search(text)
    if sent is None:
        raise ValueError("no 'Total bytes sent' in rsync's --stats output")
    return {"sent_bytes": int(sent.group(1).replace(",", "")),
            "literal_bytes": int(literal.group(1).replace(",", "")) if literal else 0}


def new_chunk_bytes(seeded: dict[str, int], new: dict[str, int]) -> tuple[int, int]:
    """(count, bytes) of the chunks in ``new`` (name → size) that ``seeded`` lacks."""
    fresh = [size for name, size in new.items() if name not in seeded]
    return len(fresh), sum(fresh)


def goals(row: dict[str, Any], peers: list[str], min_install: int = 10_000_000, ratio: float = 0.8,
          hcp_key: str = "hcp_wire_bytes") -> dict[str, Any]:
    """The issue's goals for one case: HCP (``row[hcp_key]``) ≤ ``ratio`` × the .deb bytes (only when those
    are at least ``min_install``; None otherwise), and HCP smaller than every peer measured (missing peers
    are not counted)."""
    hcp = row[hcp_key]
    debs = row.get("deb_bytes") or 0
    vs_debs = (hcp <= ratio * debs) if debs >= min_install else None
    measured = {p: row[p] for p in peers if isinstance(row.get(p), int)}
    beaten_by = sorted(p for p, v in measured.items() if v <= hcp)
    return {"hcp_le_0.8_debs": vs_debs, "hcp_smallest": not beaten_by, "peers_not_larger": beaten_by}


def block_numbers(text: str) -> set[int]:
    """The block numbers debugfs ``blocks`` printed (space-separated, one line per file)."""
    return {int(x) for x in text.split() if x.isdigit()}


def overhead(raw: Path, layer_blocks: set[int]) -> dict[str, int]:
    """Bytes of the layer's own blocks (4 KiB disk blocks; the file system starts at offset 0 with 4 KiB
    blocks) that are the ext4 journal (inode 8) and the systemd journal files (/var/log/journal/*/*)."""
    def dbg(req: str) -> str:
        return subprocess.run(["debugfs", "-c", "-R", req, str(raw)], capture_output=True, text=True).stdout
    bs = re.search(r"Block size:\s+(\d+)", dbg("stats"))
    if bs is None or int(bs.group(1)) != 4096:
        return {}
    ext4 = block_numbers(dbg("blocks <8>"))
    sysj: set[int] = set()
    for sub in _ls(dbg("ls -p /var/log/journal")):
        for f in _ls(dbg(f"ls -p /var/log/journal/{sub}")):
            sysj |= block_numbers(dbg(f"blocks /var/log/journal/{sub}/{f}"))
    return {"ext4_journal_bytes": len(ext4 & layer_blocks) * 4096,
            "systemd_journal_bytes": len(sysj & layer_blocks) * 4096}


def _ls(text: str) -> list[str]:
    names = [ln.split("/")[5] for ln in text.splitlines() if ln.count("/") >= 6]
    return [n for n in names if n not in (".", "..")]


def _files(root: Path, suffix: str) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in root.rglob(f"*{suffix}")}


def rsync_delta(old: Path, new: Path, work: Path) -> dict[str, Any]:
    """rsync -z of ``new`` onto a copy of ``old`` through a pipe remote shell; rsync's own counts."""
    dest = work / "rsync-dest"
    dest.mkdir()
    subprocess.run(["cp", "--sparse=always", str(old), str(dest / new.name)], check=True)
    rsh = work / "pipe-rsh"
    rsh.write_text('#!/bin/sh\nshift\nexec "$@"\n')       # drop the host name; run the remote rsync here
    rsh.chmod(0o755)
    t0 = time.monotonic()
    out = subprocess.run(["rsync", "-z", "--stats", "--ignore-times", "--inplace", "--no-whole-file", "--rsh", str(rsh),
                          str(new), f"localhost:{dest}/"], check=True, capture_output=True, text=True).stdout
    stats = rsync_stats(out)
    shutil.rmtree(dest)
    return {**stats, "seconds": round(time.monotonic() - t0, 1)}


class Casync:
    """A casync chunk store seeded with the old image (zstd chunks, casync's default chunk sizes)."""

    def __init__(self, old: Path, work: Path) -> None:
        self.work = work
        self.seed = work / "casync-seed.castr"
        t0 = time.monotonic()
        subprocess.run(["casync", "make", "--compression=zstd", f"--store={self.seed}", str(work / "old.caibx"),
                        str(old)], check=True, capture_output=True)
        self.seed_seconds = round(time.monotonic() - t0, 1)
        self.seeded = _files(self.seed, ".cacnk")

    def delta(self, new: Path, label: str) -> dict[str, Any]:
        store, index = self.work / f"casync-{label}.castr", self.work / f"{label}.caibx"
        t0 = time.monotonic()
        subprocess.run(["casync", "make", "--compression=zstd", f"--store={store}", str(index), str(new)],
                       check=True, capture_output=True)
        count, nbytes = new_chunk_bytes(self.seeded, _files(store, ".cacnk"))
        shutil.rmtree(store)
        return {"new_chunks": count, "new_chunk_bytes": nbytes, "index_bytes": index.stat().st_size,
                "sent_bytes": nbytes + index.stat().st_size, "seconds": round(time.monotonic() - t0, 1)}


def rdump_root(raw: Path, out: Path) -> None:
    """The whole root file system of a raw ext4 image into ``out`` (debugfs ``rdump``, read-only)."""
    out.mkdir(parents=True)
    proc = subprocess.run(["debugfs", "-c", "-R", f'rdump / "{out}"', str(raw)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"debugfs rdump of {raw.name} failed: {proc.stderr[-400:]}")


class OSTree:
    """An OSTree repository holding a commit of the old root tree; static deltas from it."""

    def __init__(self, old_root: Path, work: Path) -> None:
        self.repo = work / "ostree-repo"
        subprocess.run(["ostree", "init", f"--repo={self.repo}", "--mode=bare-user-only"], check=True,
                       capture_output=True)
        t0 = time.monotonic()
        self._commit("old", old_root)
        self.commit_seconds = round(time.monotonic() - t0, 1)

    def _commit(self, branch: str, root: Path) -> None:
        subprocess.run(["ostree", "commit", f"--repo={self.repo}", f"--branch={branch}", f"--tree=dir={root}",
                        "--canonical-permissions", "--no-xattrs", f"--subject={branch}"], check=True,
                       capture_output=True)

    def delta(self, new_root: Path, label: str) -> dict[str, Any]:
        t0 = time.monotonic()
        self._commit(label, new_root)
        commit_s = time.monotonic() - t0
        out = self.repo.parent / f"ostree-{label}.delta"
        subprocess.run(["ostree", "static-delta", "generate", f"--repo={self.repo}", "--from=old", f"--to={label}",
                        "--inline", "--min-fallback-size=0", f"--filename={out}"], check=True, capture_output=True)
        size = out.stat().st_size
        out.unlink()
        return {"sent_bytes": size, "commit_seconds": round(commit_s, 1),
                "delta_seconds": round(time.monotonic() - t0 - commit_s, 1)}


def versions() -> dict[str, str]:
    def first(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()[0]
        except (OSError, IndexError):
            return "missing"
    return {"rsync": first(["rsync", "--version"]), "casync": first(["casync", "--version"]),
            "ostree": next((ln.split("'")[1] for ln in subprocess.run(["ostree", "--version"], capture_output=True,
                            text=True).stdout.splitlines() if "Version:" in ln and "'" in ln), "missing")}
