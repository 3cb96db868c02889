"""B4's peers: libvirt incremental backup (checkpoints: a qcow2 dirty bitmap) and borg.

libvirt: ``virsh checkpoint-create`` on the running capsule's domain starts a persistent dirty bitmap in
its leaf; a minute later ``virsh backup-begin`` with ``<incremental>`` pushes the clusters written since
into a new qcow2 file (the increment). Capsule's memory snapshot saves the domain and restores it on a new
leaf, so libvirt's checkpoint (metadata of a transient domain, a bitmap in a leaf Capsule then seals)
cannot outlive it: the increment is taken and the checkpoint deleted just before each snapshot, and a new
checkpoint made just after it. The writes of the second or so between the two are in no increment.

borg: ``borg create --compression zstd,3`` of the whole raw disk (the chain flattened) and, in a second
repository, the memory image, once per snapshot; the figure is each repository's growth on disk."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from bench.backup_accounting import allocated_bytes
from capsule.runtime.connection import libvirt_uri


def _virsh(*args: str, check: bool = True) -> str:
    r = subprocess.run(["virsh", "-q", "-c", libvirt_uri(), *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"virsh {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


class LibvirtIncremental:
    """Checkpoints and incremental push backups of disk ``vda`` of one domain, into ``out``."""

    def __init__(self, out: Path, disk: str = "vda") -> None:
        self.out = out
        self.disk = disk
        self.checkpoint: str | None = None
        self.count = 0
        out.mkdir(parents=True, exist_ok=True)

    def start(self, domain: str) -> None:
        """A checkpoint on the (just resumed) domain: the next increment holds what is written from now."""
        self.count += 1
        name = f"b4-{self.count}"
        xml = self.out / f"{name}.checkpoint.xml"
        xml.write_text(f"<domaincheckpoint><name>{name}</name><disks><disk name='{self.disk}' "
                       f"checkpoint='bitmap'/></disks></domaincheckpoint>")
        _virsh("checkpoint-create", domain, str(xml))
        self.checkpoint = name

    def increment(self, domain: str, timeout: float = 300) -> dict[str, int | float]:
        """Push the clusters written since the checkpoint into a new file, wait for the job, delete the
        checkpoint (its bitmap leaves the leaf before Capsule seals it). Returns the increment's sizes."""
        assert self.checkpoint is not None, "start() first"
        target = self.out / f"{self.checkpoint}.inc.qcow2"
        xml = self.out / f"{self.checkpoint}.backup.xml"
        xml.write_text(f"<domainbackup mode='push'><incremental>{self.checkpoint}</incremental><disks>"
                       f"<disk name='{self.disk}' type='file'><target file='{target}'/><driver type='qcow2'/>"
                       f"</disk></disks></domainbackup>")
        t0 = time.monotonic()
        _virsh("backup-begin", domain, str(xml))
        while "None" not in _virsh("domjobinfo", domain).split("\n", 1)[0]:
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"libvirt backup of {domain} did not finish in {timeout:.0f} s")
            time.sleep(0.2)
        seconds = time.monotonic() - t0
        _virsh("checkpoint-delete", domain, self.checkpoint)
        self.checkpoint = None
        # the increment's backing file is the running leaf (QEMU holds its lock): -U, and only depth 0 counts
        extents = json.loads(subprocess.run(["qemu-img", "map", "-U", "--output=json", str(target)], check=True,
                                            capture_output=True, text=True).stdout)
        data = allocated_bytes(extents)
        zst = subprocess.run(["zstd", "-3", "-q", "-c", str(target)], check=True, capture_output=True).stdout
        result = {"bytes": data, "file_bytes": target.stat().st_size, "zstd_bytes": len(zst),
                  "seconds": round(seconds, 2)}
        target.unlink()
        return result


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Borg:
    """One borg repository (no encryption, zstd level 3, borg's default chunker)."""

    def __init__(self, repo: Path, base: Path) -> None:
        self.repo = repo
        self.env = {**os.environ, "BORG_BASE_DIR": str(base), "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes",
                    "BORG_RELOCATED_REPO_ACCESS_IS_OK": "yes"}
        subprocess.run(["borg", "init", "--encryption=none", str(repo)], check=True, capture_output=True,
                       env=self.env)
        self.count = 0

    def backup(self, paths: list[Path]) -> dict[str, int | float]:
        """One archive of ``paths``; returns the repository's growth on disk and the time it took."""
        before = tree_bytes(self.repo)
        self.count += 1
        t0 = time.monotonic()
        subprocess.run(["borg", "create", "--compression", "zstd,3", f"{self.repo}::s{self.count}",
                        *[str(p) for p in paths]], check=True, capture_output=True, env=self.env,
                       cwd=paths[0].parent)
        return {"growth_bytes": tree_bytes(self.repo) - before, "seconds": round(time.monotonic() - t0, 1)}


def borg_version() -> str:
    return subprocess.run(["borg", "--version"], check=True, capture_output=True, text=True).stdout.strip()


def libvirt_version() -> str:
    """``Using library: libvirt 11.3.0`` → ``11.3.0``."""
    line = next((x for x in _virsh("version").splitlines() if x.startswith("Using library")), "")
    return line.rsplit(" ", 1)[-1]
