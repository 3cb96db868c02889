"""Fetch Debian's cloud kernel package and work out which of its modules a guest needs."""

from __future__ import annotations

import contextlib
import gzip
import lzma
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from .common import ImageBuildError, Progress, run, say

KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
_APT_HINT = "run `apt-get update` so apt knows the bookworm kernel packages"


@dataclass
class KernelDeb:
    package: str  # versioned package, e.g. linux-image-6.1.0-56-cloud-amd64
    version: str  # Debian version of that package
    path: Path  # the cached .deb


def resolve_kernel_package(meta: str = KERNEL_META_PACKAGE) -> tuple[str, str]:
    """The versioned kernel package the meta package depends on, and its candidate version."""
    out = run(["apt-cache", "depends", meta], f"resolve {meta}", hint=_APT_HINT).stdout.decode()
    pkg = None
    for line in out.splitlines():
        m = re.match(r"\s*\|?Depends:\s*(linux-image-\S+)", line)
        if m and not m.group(1).startswith("<"):
            pkg = m.group(1)
            break
    if pkg is None:
        raise ImageBuildError(f"resolve {meta}: no linux-image dependency in `apt-cache depends`:\n{out}")
    pol = run(["apt-cache", "policy", pkg], f"resolve {pkg}", hint=_APT_HINT).stdout.decode()
    m = re.search(r"^\s*Candidate:\s*(\S+)", pol, re.M)
    if not m or m.group(1) == "(none)":
        raise ImageBuildError(f"resolve {pkg}: apt has no installable version ({_APT_HINT}):\n{pol}")
    return pkg, m.group(1)


def fetch_kernel_deb(cache: Path, progress: Progress | None = None) -> KernelDeb:
    """Download the cloud kernel .deb into the cache (once); return the cached file."""
    arch = run(["dpkg", "--print-architecture"], "dpkg architecture").stdout.decode().strip()
    try:
        pkg, version = resolve_kernel_package()
    except ImageBuildError:
        cached = sorted(cache.glob("linux-image-*-cloud-*.deb"), key=lambda p: p.stat().st_mtime)
        if not cached:
            raise
        path = cached[-1]
        say(progress, f"apt cannot resolve {KERNEL_META_PACKAGE}; using cached {path.name}")
        name, version, _ = path.name.split("_", 2)
        return KernelDeb(name, version, path)
    path = cache / f"{pkg}_{quote(version, safe='+.~-')}_{arch}.deb"
    if path.is_file() and path.stat().st_size > 0:
        say(progress, f"kernel package {pkg} {version}: cached")
        return KernelDeb(pkg, version, path)
    say(progress, f"downloading {pkg} {version}")
    with tempfile.TemporaryDirectory(prefix=".dl-", dir=cache) as tmp:
        # apt drops privileges to _apt for downloads when it can write the directory
        with contextlib.suppress(LookupError, OSError):
            shutil.chown(tmp, user="_apt")
        run(["apt-get", "download", f"{pkg}={version}"], f"download {pkg}", cwd=Path(tmp), hint=_APT_HINT)
        debs = list(Path(tmp).glob("*.deb"))
        if len(debs) != 1:
            raise ImageBuildError(f"download {pkg}: expected one .deb, apt-get left {debs}")
        os.replace(debs[0], path)
    return KernelDeb(pkg, version, path)


@dataclass
class ExtractedKernel:
    release: str  # uname -r
    vmlinuz: Path
    config: dict[str, str]  # CONFIG_X -> y/m/...
    moddir: Path  # .../lib/modules/<release>


def extract_kernel(deb: Path, dest: Path) -> ExtractedKernel:
    run(["dpkg-deb", "-x", deb, dest], f"unpack {deb.name}")
    boot = dest / "boot"
    kernels = sorted(boot.glob("vmlinuz-*"))
    if len(kernels) != 1:
        raise ImageBuildError(f"unpack {deb.name}: expected one boot/vmlinuz-*, found {kernels}")
    release = kernels[0].name[len("vmlinuz-") :]
    config = parse_kconfig(boot / f"config-{release}")
    for base in (dest / "lib" / "modules", dest / "usr" / "lib" / "modules"):
        if (base / release).is_dir():
            return ExtractedKernel(release, kernels[0], config, base / release)
    raise ImageBuildError(f"unpack {deb.name}: no lib/modules/{release} directory")


def parse_kconfig(path: Path) -> dict[str, str]:
    conf: dict[str, str] = {}
    if not path.is_file():
        return conf
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("CONFIG_") and "=" in line:
            k, v = line.split("=", 1)
            conf[k] = v.strip('"')
    return conf


def norm_module(name: str) -> str:
    for suffix in (".xz", ".zst", ".gz"):
        name = name.removesuffix(suffix)
    return name.removesuffix(".ko").replace("-", "_")


def read_module(path: Path) -> bytes:
    """The raw ELF of a kernel module, decompressing .ko.xz/.ko.gz/.ko.zst."""
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if path.name.endswith(".gz"):
        return gzip.decompress(data)
    if path.name.endswith(".zst"):
        try:
            import zstandard  # type: ignore[import-not-found]

            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        except ImportError:
            return subprocess.run(["zstd", "-dc", str(path)], capture_output=True, check=True).stdout
    return data


def modinfo(elf: bytes) -> dict[str, list[str]]:
    """The key=value strings of an ELF64 module's .modinfo section."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not an ELF64 kernel module")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _typ, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        return name, off, size

    _, stroff, _ = section(shstrndx)
    info: dict[str, list[str]] = {}
    for i in range(shnum):
        name_off, off, size = section(i)
        end = elf.index(b"\0", stroff + name_off)
        if elf[stroff + name_off : end] != b".modinfo":
            continue
        for item in elf[off : off + size].split(b"\0"):
            if b"=" in item:
                k, v = item.decode("utf-8", "replace").split("=", 1)
                info.setdefault(k, []).append(v)
    return info


class ModuleTree:
    """Modules of one unpacked kernel: find files, built-ins and dependency order."""

    def __init__(self, moddir: Path) -> None:
        self.moddir = moddir
        self.files: dict[str, Path] = {}
        for p in (moddir / "kernel").rglob("*.ko*"):
            self.files[norm_module(p.name)] = p
        self.builtin: set[str] = set()
        builtin = moddir / "modules.builtin"
        if builtin.is_file():
            self.builtin = {norm_module(Path(x).name) for x in builtin.read_text().split()}
        self._info: dict[str, dict[str, list[str]]] = {}

    def info(self, name: str) -> dict[str, list[str]]:
        if name not in self._info:
            self._info[name] = modinfo(read_module(self.files[name]))
        return self._info[name]

    def deps(self, name: str) -> list[str]:
        info = self.info(name)
        hard = [d for v in info.get("depends", []) for d in v.split(",") if d]
        soft: list[str] = []
        for v in info.get("softdep", []):
            # "pre: a b post: c" -- only the pre: part has to be loaded first
            m = re.search(r"pre:\s*([^:]*?)(?:\s+\w+:|$)", v)
            if m:
                soft += [s for s in m.group(1).split() if norm_module(s) in self.files]
        return [norm_module(d) for d in hard + soft]

    def load_order(self, wanted: list[str]) -> tuple[list[str], list[str]]:
        """(modules to insmod, dependencies first; wanted names that are built into the kernel)."""
        order: list[str] = []
        builtin: list[str] = []
        seen: set[str] = set()

        def visit(name: str, stack: tuple[str, ...]) -> None:
            if name in seen:
                return
            if name in self.builtin and name not in self.files:
                seen.add(name)
                builtin.append(name)
                return
            if name not in self.files:
                raise ImageBuildError(
                    f"kernel module {name!r} (needed by {' -> '.join(stack) or 'the guest'}) is neither "
                    f"built in nor shipped in {self.moddir}"
                )
            seen.add(name)
            for dep in self.deps(name):
                visit(dep, (*stack, name))
            order.append(name)

        for w in wanted:
            visit(norm_module(w), ())
        return order, builtin

    def relpath(self, name: str) -> str:
        """Path of the uncompressed module inside lib/modules/<release>/."""
        rel = self.files[name].relative_to(self.moddir).as_posix()
        for suffix in (".xz", ".zst", ".gz"):
            rel = rel.removesuffix(suffix)
        return rel
