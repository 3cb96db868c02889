"""The "tiny" guest: Debian's cloud kernel + a static busybox initramfs; boots in seconds under TCG."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .common import (
    MARKER,
    BuiltImage,
    ImageBuildError,
    Progress,
    Stopwatch,
    agent_binary,
    agent_info,
    cache_dir,
    file_size_info,
    is_static_elf,
    say,
)
from .cpio import CpioWriter
from .kernel import ModuleTree, extract_kernel, fetch_kernel_deb, read_module

TINY_CMDLINE = "console=ttyS0,115200 quiet panic=-1"
"""panic=-1 reboots at once on a panic; the panic text is printed first even with `quiet`
(KERN_EMERG), and under plain QEMU `-no-reboot` turns that into an exit instead of a loop."""

TINY_MODULES = ("virtio_pci", "virtio_blk", "virtio_console", "virtio_balloon", "virtio_net", "virtio_rng")
DISK_BYTES = 64 * 1024 * 1024
BLOCK_SIZE = 4096
PATTERN_BLOCKS = 1024  # the first 4 MiB hold the pattern, the rest is zeros (holes)


def pattern_block(i: int) -> bytes:
    """Contents of 4 KiB block i (< PATTERN_BLOCKS) of the tiny disk: a 32-byte record repeated."""
    record = f"CAPSULE-TINY-DISK block #{i:06d}\n".encode()
    assert len(record) == 32
    return record * (BLOCK_SIZE // len(record))


def expected_md5(first_block: int, count: int) -> str:
    """md5 of `dd if=/dev/vda bs=4096 skip=first_block count=count` on a pristine tiny disk."""
    h = hashlib.md5()
    for i in range(first_block, first_block + count):
        h.update(pattern_block(i) if i < PATTERN_BLOCKS else bytes(BLOCK_SIZE))
    return h.hexdigest()


def write_tiny_disk(path: Path) -> None:
    with path.open("wb") as f:
        for i in range(PATTERN_BLOCKS):
            f.write(pattern_block(i))
        f.truncate(DISK_BYTES)  # the rest stays a hole


def find_static_busybox() -> Path:
    candidates = [Path(p) for p in (shutil.which("busybox"), "/bin/busybox", "/usr/bin/busybox") if p]
    for c in candidates:
        if c.is_file() and is_static_elf(c):
            return c
    raise ImageBuildError(
        "no static busybox found (looked at "
        + ", ".join(str(c) for c in candidates)
        + "); install the Debian package busybox-static"
    )


INIT_SCRIPT = r"""#!/bin/sh
# Capsule tiny guest, PID 1: set up, load virtio drivers, announce readiness,
# then hand over to busybox init, which keeps a root shell on the console
# and the guest agent (/sbin/capsule-agent) running.
export PATH=/sbin:/bin:/usr/sbin:/usr/bin HOME=/root
mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mount -t devtmpfs -o mode=0755,nosuid devtmpfs /dev
exec </dev/console >/dev/console 2>&1
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs /run
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /tmp
hostname capsule-tiny
while read -r ko; do
    [ -n "$ko" ] && { insmod "/lib/modules/$(uname -r)/$ko" || echo "capsule-tiny: insmod $ko failed"; }
done < /etc/capsule/modules
i=0
while [ ! -b /dev/vda ] && [ "$i" -lt 100 ]; do usleep 100000; i=$((i + 1)); done
[ -b /dev/vda ] || echo "capsule-tiny: WARNING: /dev/vda did not appear within 10 s"
# a fresh line: firmware may have left escape sequences on the current one
echo
echo "@MARKER@"
exec /sbin/init
"""

AGENT_PATH = "sbin/capsule-agent"
AGENT_LOG = "/run/capsule-agent.log"

INITTAB = f"""\
# busybox init: a root shell on the kernel console (ttyS0), respawned whenever it exits.
# cttyhack makes it the controlling terminal, so job control (&, fg, ^C) works.
::respawn:/bin/cttyhack /bin/sh -l
# the guest agent (virtio-serial port org.capsule.agent.0; /init loaded virtio_console already).
# Its log goes to a file, never to the console: the host types into that shell.
# (busybox init runs a line with redirections as `sh -c 'exec ...'`, so it supervises the agent itself)
::respawn:/{AGENT_PATH} </dev/null >/dev/null 2>>{AGENT_LOG}
::ctrlaltdel:/sbin/reboot
::shutdown:/bin/sync
"""

PROFILE = """\
export PATH=/sbin:/bin:/usr/sbin:/usr/bin HOME=/root
export PS1='# '
cd /root 2>/dev/null
"""


def build_tiny(workdir: Path, progress: Progress | None = None) -> BuiltImage:
    """Build the tiny guest (kernel, busybox initramfs, 64 MiB patterned raw disk) into workdir."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    clock = Stopwatch()
    busybox = find_static_busybox()
    agent = agent_binary(progress)
    agent_meta = agent_info(agent)
    deb = fetch_kernel_deb(cache_dir(workdir), progress)
    clock.lap("fetch_kernel")

    with tempfile.TemporaryDirectory(prefix="tiny-", dir=workdir) as tmp:
        say(progress, f"unpacking {deb.path.name}")
        kern = extract_kernel(deb.path, Path(tmp) / "deb")
        clock.lap("unpack_kernel")
        tree = ModuleTree(kern.moddir)
        order, builtin = tree.load_order(list(TINY_MODULES))
        say(progress, f"modules to load: {', '.join(order)}")

        cpio = CpioWriter()
        for d in ("dev", "proc", "sys", "run", "tmp", "root", "etc/capsule", "mnt", "var/log"):
            cpio.add_dir(d, 0o1777 if d == "tmp" else 0o755)
        cpio.add_chardev("dev/console", 5, 1, 0o600)
        cpio.add_chardev("dev/null", 1, 3, 0o666)
        cpio.add_file("bin/busybox", busybox.read_bytes(), 0o755)
        applets = subprocess.run(
            [str(busybox), "--list-full"], capture_output=True, check=True, text=True
        ).stdout.split()
        for applet in applets:
            if applet != "bin/busybox" and applet not in ("linuxrc",):
                cpio.add_symlink(applet, "/bin/busybox")
        for needed in ("bin/sh", "bin/cttyhack", "sbin/init", "sbin/insmod", "bin/dd", "usr/bin/md5sum"):
            if needed not in cpio:
                raise ImageBuildError(f"{busybox} lacks the {needed.rsplit('/', 1)[-1]} applet")
        rel_paths = []
        dep_lines = []
        for name in order:
            rel = tree.relpath(name)
            rel_paths.append(rel)
            cpio.add_file(f"lib/modules/{kern.release}/{rel}", read_module(tree.files[name]), 0o644)
            deps = " ".join(tree.relpath(d) for d in tree.deps(name) if d in tree.files)
            dep_lines.append(f"{rel}: {deps}".rstrip())
        cpio.add_file(f"lib/modules/{kern.release}/modules.dep", ("\n".join(dep_lines) + "\n").encode())
        cpio.add_file("etc/capsule/modules", ("\n".join(rel_paths) + "\n").encode())
        cpio.add_file(AGENT_PATH, agent.read_bytes(), 0o755)
        cpio.add_file("init", INIT_SCRIPT.replace("@MARKER@", MARKER).encode(), 0o755)
        cpio.add_file("etc/inittab", INITTAB.encode())
        cpio.add_file("etc/profile", PROFILE.encode())
        cpio.add_file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
        cpio.add_file("etc/group", b"root:x:0:\ntty:x:5:\n")
        cpio.add_file("etc/hostname", b"capsule-tiny\n")
        release = f"capsule-tiny kernel={kern.release} agent={agent_meta['version']}\n"
        cpio.add_file("etc/capsule/release", release.encode())
        archive = cpio.render()

        initrd = workdir / "initramfs.img"
        compression = _compress(archive, initrd, kern.config)
        kernel = workdir / "vmlinuz"
        shutil.copyfile(kern.vmlinuz, kernel)
        clock.lap("initramfs")

    disk = workdir / "disk.raw"
    write_tiny_disk(disk)
    clock.lap("disk")
    say(progress, f"tiny image ready in {clock.total():.1f} s")
    info = {
        "kernel_package": deb.package,
        "kernel_package_version": deb.version,
        "kernel_release": kern.release,
        "modules_loaded": order,
        "modules_builtin": builtin,
        "busybox": subprocess.run([str(busybox)], capture_output=True, text=True).stdout.splitlines()[0],
        "agent_version": agent_meta["version"],
        "agent_protocol": agent_meta["protocol"],
        "agent_sha256": agent_meta["sha256"],
        "agent_bytes": agent_meta["bytes"],
        "agent_path": "/" + AGENT_PATH,
        "agent_log": AGENT_LOG,
        "initramfs_compression": compression,
        "initramfs_uncompressed_bytes": len(archive),
        "sizes": {
            "kernel": file_size_info(kernel),
            "initrd": file_size_info(initrd),
            "disk_raw": file_size_info(disk),
        },
        "disk": {
            "bytes": DISK_BYTES,
            "block_size": BLOCK_SIZE,
            "pattern_blocks": PATTERN_BLOCKS,
            "pattern": "block i = 'CAPSULE-TINY-DISK block #%06d\\n' % i repeated 128 times",
            "md5_block0": expected_md5(0, 1),
            "md5_pattern": expected_md5(0, PATTERN_BLOCKS),
        },
        "build_seconds": clock.total(),
        "build_steps": clock.laps,
    }
    return BuiltImage("tiny", kernel, initrd, disk, TINY_CMDLINE, MARKER, info)


def _compress(archive: bytes, dest: Path, config: dict[str, str]) -> str:
    if config.get("CONFIG_RD_ZSTD") == "y" and shutil.which("zstd"):
        tmp = dest.with_suffix(".tmp")
        subprocess.run(["zstd", "-q", "-f", "-19", "-o", str(tmp)], input=archive, check=True)
        os.replace(tmp, dest)
        return "zstd"
    dest.write_bytes(gzip.compress(archive, compresslevel=9, mtime=0))
    return "gzip"
