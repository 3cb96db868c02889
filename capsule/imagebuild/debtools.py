"""apt and dpkg helpers of the Debian image builder: the host's apt sources, what a tree has installed,
the .deb cache, a tree's size."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import quote

from .common import ImageBuildError, run

SUITE = "bookworm"


def host_apt_sources() -> list[Path]:
    """The host's own apt source files that serve bookworm (apt's configured locations)."""
    out = run(
        ["apt-config", "shell", "SL", "Dir::Etc::sourcelist/f", "SP", "Dir::Etc::sourceparts/d"],
        "read apt configuration",
    ).stdout.decode()
    found = dict(re.findall(r"^(SL|SP)='([^']*)'", out, re.M))
    files: list[Path] = []
    if found.get("SL"):
        files.append(Path(found["SL"]))
    if found.get("SP") and Path(found["SP"]).is_dir():
        parts = Path(found["SP"])
        files += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources"))
    keep = []
    for f in files:
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        active = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if any(SUITE in ln for ln in active) and not re.search(r"^\s*Enabled:\s*no", text, re.M | re.I):
            keep.append(f)
    if not keep:
        raise ImageBuildError(
            f"no apt source for Debian {SUITE} on this host "
            f"(looked at {', '.join(map(str, files)) or 'nothing'}); configure apt for {SUITE} first"
        )
    return keep


def prune_deb_cache(debs: Path, installed: dict[str, str]) -> None:
    """Keep only the .debs of the versions just installed, so the cache does not grow forever."""
    wanted = {f"{pkg}_{quote(ver, safe='+.~-')}_" for pkg, ver in installed.items()}
    for deb in debs.glob("*.deb"):
        name, ver, _ = deb.name.split("_", 2)
        if f"{name}_{ver}_" not in wanted:
            deb.unlink()


def installed_packages(root: Path) -> dict[str, str]:
    out = run(
        [
            "dpkg-query",
            f"--admindir={root / 'var/lib/dpkg'}",
            "-W",
            "-f",
            "${Package} ${Version} ${Status}\n",
        ],
        "list installed packages",
    ).stdout.decode()
    pkgs = {}
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[2].endswith(" installed"):
            pkgs[parts[0]] = parts[1]
    return pkgs


def dir_bytes(root: Path) -> int:
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total
