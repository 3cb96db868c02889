"""The "debian" guest: a bookworm system with systemd, built by mmdebstrap, on a bare ext4 disk.

One builder for every Debian-based image: a :class:`Flavour` says what an image adds to the plain guest
(its kernel package, packages, dpkg path filters, initrd modules, commands in the chroot, files written
into the tree, its marker). ``DEBIAN`` is the plain guest; ``desktop.DESKTOP`` adds a graphical session."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .common import (
    AGENT_PORT,
    MARKER,
    POD_LAYER_PATH,
    BuiltImage,
    ImageBuildError,
    Progress,
    Stopwatch,
    agent_binary,
    agent_info,
    cache_dir,
    file_size_info,
    pod_layer_files,
    pod_layer_sha256,
    require_root,
    run,
    run_streaming,
    safe_rmtree,
    say,
)
from .debtools import SUITE, dir_bytes, host_apt_sources, installed_packages, prune_deb_cache

DISK_LABEL = "capsule-root"
HOSTNAME = "capsule-guest"
FSTAB_ROOT = "/dev/vda / ext4 defaults 0 1"
BASE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "udev",
    "dbus",
    "initramfs-tools",
    "zstd",
    "e2fsprogs",
    "iproute2",
    "procps",
    "python3",
    "criu",
    "kmod",
)
KERNEL_PACKAGE = "linux-image-cloud-amd64"
DEBIAN_CMDLINE = "root=/dev/vda rw console=ttyS0,115200 quiet panic=-1"
"""Under TCG the boot (~11 s to the marker) is mostly udev and systemd; fsck.mode=skip and
i8042 tweaks were measured and gained nothing, so the command line stays plain."""

# Units that would wake up to write to the disk behind Capsule's back (or prompt on first boot).
MASKED_UNITS = (
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "apt-daily.service",
    "apt-daily-upgrade.service",
    "man-db.timer",
    "man-db.service",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
    "dpkg-db-backup.timer",
    "systemd-firstboot.service",
)
# Modules that must be in the initrd for a virtio root disk; ext4 is built into the cloud kernel.
INITRD_MODULES = ("virtio_pci", "virtio_blk", "virtio_scsi", "virtio_console", "virtio_balloon")

INITRAMFS_HOOK = """#!/bin/sh
# Capsule: make sure the virtio drivers for the root disk are in the initrd and loaded early.
PREREQ=""
prereqs() { echo "$PREREQ"; }
case "$1" in prereqs) prereqs; exit 0 ;; esac
. /usr/share/initramfs-tools/hook-functions
for m in @MODULES@; do
    force_load "$m" || true
done
"""

AGENT_PATH = "/usr/local/sbin/capsule-agent"

AGENT_UNIT = f"""[Unit]
Description=Capsule guest agent (virtio-serial port {AGENT_PORT})
# it waits for its port itself; restart it forever, however often it dies
StartLimitIntervalSec=0

[Service]
Type=exec
ExecStart={AGENT_PATH}
Restart=always
RestartSec=1
# its log goes to the journal, never to the serial console (the host types into that shell)
StandardInput=null
StandardOutput=journal
StandardError=journal
# no OOMScoreAdjust: the agent sets its own (1000 while ballooning, -1000 while file systems are frozen)

[Install]
WantedBy=multi-user.target
"""

READY_UNIT = f"""[Unit]
Description=Tell the host on the serial console that the Capsule guest is up
# the agent is running (exec'd) by the time the marker appears
After=basic.target systemd-user-sessions.service capsule-agent.service
# print before agetty takes over (and hangs up) ttyS0
Before=serial-getty@ttyS0.service getty.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'printf "\\\\r\\\\n{MARKER}\\\\r\\\\n" > /dev/ttyS0'

[Install]
WantedBy=multi-user.target
"""

AUTOLOGIN_DROPIN = """[Service]
ExecStart=
ExecStart=-/sbin/agetty --autologin root --noclear --keep-baud 115200,57600,38400,9600 - $TERM
"""

DPKG_EXCLUDES = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
)


@dataclass(frozen=True)
class Flavour:
    """What an image adds to the plain Debian guest (the plain guest is ``DEBIAN``)."""

    kind: str
    kernel_package: str = KERNEL_PACKAGE
    packages: tuple[str, ...] = ()
    dpkg_excludes: tuple[str, ...] = ()  # dpkg path filters on top of DPKG_EXCLUDES (files never unpacked)
    initrd_modules: tuple[str, ...] = ()  # forced into the initrd and loaded early, on top of INITRD_MODULES
    initrd_modules_only: bool = False  # initramfs-tools MODULES=list: only those (not "most" of the kernel's)
    chroot_commands: tuple[str, ...] = ()  # shell commands run in the finished tree's chroot, in order
    configure: Callable[[Path], None] | None = None  # writes its files into the tree, after the guest's own
    cmdline: str = DEBIAN_CMDLINE
    marker: str = MARKER

    def all_packages(self, extra: Sequence[str] = ()) -> list[str]:
        return list(dict.fromkeys([*BASE_PACKAGES, self.kernel_package, *self.packages, *extra]))

    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*INITRD_MODULES, *self.initrd_modules]))


# MODULES=list: the initrd holds only the virtio drivers (INITRD_MODULES; ext4 is built into the cloud
# kernel), not "most" of the kernel's modules. It travels whole before a demand-paged boot, so every
# module it carries that the virtual hardware never loads is bytes on the link (13 MB against ~2 MB).
DEBIAN = Flavour("debian", initrd_modules_only=True)


def write_file(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def enable_unit(system: Path, unit: str, target: str = "multi-user.target") -> None:
    """What `systemctl enable` does for a unit in /etc/systemd/system with WantedBy=target."""
    wants = system / f"{target}.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / unit
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(f"/etc/systemd/system/{unit}")


def _configure_tree(root: Path, agent: Path) -> None:
    """Capsule's settings, written straight into the unpacked tree (after mmdebstrap finished)."""
    etc = root / "etc"
    write_file(etc / "hostname", HOSTNAME + "\n")
    write_file(
        etc / "hosts",
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    )
    write_file(etc / "fstab", "# <device> <mount point> <type> <options> <dump> <pass>\n" + FSTAB_ROOT + "\n")
    # no leftovers of the build host: resolver and identity
    resolv = etc / "resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text("")
    write_file(etc / "machine-id", "")  # empty: systemd makes one at first boot (no first-boot prompts)
    dbus_id = root / "var/lib/dbus/machine-id"
    if dbus_id.exists() and not dbus_id.is_symlink():
        dbus_id.unlink()
    # root: no password
    shadow = etc / "shadow"
    lines = shadow.read_text().splitlines()
    lines = [re.sub(r"^root:[^:]*:", "root::", ln) for ln in lines]
    shadow.write_text("\n".join(lines) + "\n")
    # serial console: autologin root
    write_file(etc / "systemd/system/serial-getty@ttyS0.service.d/autologin.conf", AUTOLOGIN_DROPIN)
    # readiness marker
    system = etc / "systemd/system"
    write_file(system / "capsule-ready.service", READY_UNIT)
    enable_unit(system, "capsule-ready.service")
    # the guest agent, started at boot and restarted whenever it exits
    dest = root / AGENT_PATH.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(agent, dest)
    dest.chmod(0o755)
    write_file(system / "capsule-agent.service", AGENT_UNIT)
    enable_unit(system, "capsule-agent.service")
    # the pod layer (pods/): `python3 -m pods` as root, driven by the host through the agent
    pods = root / POD_LAYER_PATH.lstrip("/")
    if pods.exists():
        shutil.rmtree(pods)
    pods.mkdir(parents=True)
    for src in pod_layer_files():
        shutil.copyfile(src, pods / src.name)
        (pods / src.name).chmod(0o644)
    if (root / "usr/bin/python3").exists():
        # compiled by the guest's own python now, or the first pod call of every capsule compiles it
        # (0.7 s on a quiet TCG guest, seconds under load: the restore of a pod moved into a new capsule)
        run(["chroot", str(root), "python3", "-m", "compileall", "-q", "--invalidation-mode",
             "checked-hash", POD_LAYER_PATH], "compile the pod layer in the image", timeout=300)
    for unit in MASKED_UNITS:
        target = system / unit
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to("/dev/null")
    # a quieter, smaller journal
    write_file(etc / "systemd/journald.conf.d/capsule.conf", "[Journal]\nSystemMaxUse=32M\n")
    # apt lists (mmdebstrap cleans them too; be sure)
    lists = root / "var/lib/apt/lists"
    if lists.is_dir():
        for p in lists.iterdir():
            if p.is_file():
                p.unlink()
            elif p.is_dir() and p.name != "partial":
                shutil.rmtree(p)


def build_debian(
    workdir: Path,
    progress: Progress | None = None,
    disk_size: str = "2G",
    extra_packages: Sequence[str] = (),
    flavour: Flavour = DEBIAN,
) -> BuiltImage:
    """Build a Debian bookworm guest (systemd, cloud kernel, criu) as kernel + initrd + raw ext4 disk;
    ``flavour`` adds what another kind of image needs on top (see :class:`Flavour`)."""
    require_root(f"building the {flavour.kind} guest image")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for tool, pkg in (("mmdebstrap", "mmdebstrap"), ("mkfs.ext4", "e2fsprogs")):
        if shutil.which(tool) is None:
            raise ImageBuildError(f"{tool} not found: install the Debian package {pkg}")
    if not re.fullmatch(r"\d+[KMGT]?", disk_size):
        raise ImageBuildError(f"disk_size {disk_size!r}: use a number with an optional K/M/G/T suffix")
    pkg_rx = re.compile(r"[a-z0-9][a-z0-9+.\-]*(:[a-z0-9]+)?(=[\w.+~:-]+)?")
    bad = [p for p in extra_packages if not pkg_rx.fullmatch(p)]
    if bad:
        raise ImageBuildError(f"not Debian package names: {bad}")
    clock = Stopwatch()
    agent = agent_binary(progress)  # before the long mmdebstrap run: a missing compiler fails fast
    agent_meta = agent_info(agent)
    sources = host_apt_sources()
    packages = flavour.all_packages(extra_packages)
    debcache = cache_dir(workdir) / f"{flavour.kind}-debs"  # per kind: each build keeps only its own .debs
    debcache.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix="debian-", dir=workdir))
    try:
        tree = tmp / "tree"
        hook = tmp / "capsule-virtio"
        hook.write_text(INITRAMFS_HOOK.replace("@MODULES@", " ".join(flavour.modules())))
        hook.chmod(0o755)
        initrd_list = tmp / "initrd-list.txt"
        newcache = tmp / "debs"
        newcache.mkdir()
        q = shlex.quote
        cmd: list[str] = [
            "mmdebstrap",
            "--mode=root",
            "--format=directory",
            "--variant=minbase",
            "--include=" + ",".join(packages),
            '--aptopt=Acquire::Languages "none"',
            *(f"--dpkgopt={o}" for o in (*DPKG_EXCLUDES, *flavour.dpkg_excludes)),
            "--skip=essential/unlink",
            # reuse the .debs of the last build
            f'--setup-hook=mkdir -p "$1/var/cache/apt/archives/partial" && find {q(str(debcache))} '
            '-maxdepth 1 -name "*.deb" -exec cp -t "$1/var/cache/apt/archives/" {} +',
            # before the kernel is installed: our initramfs-tools hook, so the first initrd has virtio
            f'--essential-hook=mkdir -p "$1/etc/initramfs-tools/hooks" && '
            f'cp {q(str(hook))} "$1/etc/initramfs-tools/hooks/capsule-virtio"'
            + (' && mkdir -p "$1/etc/initramfs-tools/conf.d" && echo MODULES=list '
               '> "$1/etc/initramfs-tools/conf.d/capsule.conf"' if flavour.initrd_modules_only else ""),
            *(f'--customize-hook=chroot "$1" sh -ec {q(c)}' for c in flavour.chroot_commands),
            f"--customize-hook=sync-out /var/cache/apt/archives {q(str(newcache))}",
            f'--customize-hook=chroot "$1" sh -c "lsinitramfs /boot/initrd.img-*" > {q(str(initrd_list))}',
            SUITE,
            str(tree),
            *(str(s) for s in sources),
        ]
        say(
            progress,
            f"mmdebstrap {SUITE}: {len(packages)} packages asked for, {len(sources)} apt source file(s)",
        )

        def on_line(line: str) -> None:
            if line.startswith(("I: ", "E: ", "W: ")):
                say(progress, "mmdebstrap: " + line)

        run_streaming(
            cmd,
            "mmdebstrap",
            workdir / "mmdebstrap.log",
            on_line=on_line,
            hint="check `apt-get update` works on this host and the package names exist in bookworm",
        )
        clock.lap("mmdebstrap")

        installed = installed_packages(tree)
        # refresh the .deb cache from this build
        for old in debcache.glob("*.deb"):
            old.unlink()
        for deb in newcache.glob("*.deb"):
            os.replace(deb, debcache / deb.name)
        prune_deb_cache(debcache, installed)

        kernels = sorted((tree / "boot").glob("vmlinuz-*"))
        initrds = sorted((tree / "boot").glob("initrd.img-*"))
        if len(kernels) != 1 or len(initrds) != 1:
            raise ImageBuildError(f"expected one kernel and one initrd in /boot, not {kernels} and {initrds}")
        release = kernels[0].name[len("vmlinuz-") :]
        listing = initrd_list.read_text() if initrd_list.exists() else ""
        missing = [m for m in ("virtio_pci", "virtio_blk") if not re.search(rf"/{m}\.ko", listing)]
        if missing:
            raise ImageBuildError(f"the initrd lacks {missing}; lsinitramfs said:\n{listing[-2000:]}")
        kernel = workdir / "vmlinuz"
        initrd = workdir / "initrd.img"
        shutil.copyfile(kernels[0], kernel)
        shutil.copyfile(initrds[0], initrd)

        _configure_tree(tree, agent)
        if flavour.configure is not None:
            flavour.configure(tree)
        tree_bytes = dir_bytes(tree)
        clock.lap("configure")

        disk = workdir / "disk.raw"
        if disk.exists():
            disk.unlink()
        say(progress, f"mkfs.ext4 -d ({tree_bytes / 2**20:.0f} MiB of files) into a {disk_size} disk")
        run(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                "-d",
                tree,
                "-b",
                "4096",
                "-L",
                DISK_LABEL,
                "-E",
                "lazy_itable_init=0,lazy_journal_init=0",
                disk,
                disk_size,
            ],
            "make the root file system",
            hint="is disk_size big enough for the tree?",
        )
        clock.lap("mkfs")
    finally:
        safe_rmtree(tmp)

    extras = list(extra_packages)
    say(progress, f"{flavour.kind} image ready in {clock.total():.0f} s")
    info = {
        "suite": SUITE,
        "kernel_release": release,
        "kernel_package_version": installed.get(f"linux-image-{release}", ""),
        "packages_requested": packages,
        "extra_packages": extras,
        "package_count": len(installed),
        "packages": {p: installed[p] for p in packages if p in installed},
        "initrd_has": [m for m in flavour.modules() if re.search(rf"/{m}\.ko", listing)],
        "agent_version": agent_meta["version"],
        "agent_protocol": agent_meta["protocol"],
        "agent_sha256": agent_meta["sha256"],
        "agent_bytes": agent_meta["bytes"],
        "agent_path": AGENT_PATH,
        "agent_unit": "capsule-agent.service",
        "pods_sha256": pod_layer_sha256(),
        "pods_path": POD_LAYER_PATH,
        "tree_bytes": tree_bytes,
        "disk_size": disk_size,
        "disk_label": DISK_LABEL,
        "sizes": {
            "kernel": file_size_info(kernel),
            "initrd": file_size_info(initrd),
            "disk_raw": file_size_info(disk),
        },
        "build_seconds": clock.total(),
        "build_steps": clock.laps,
    }
    return BuiltImage(flavour.kind, kernel, initrd, disk, flavour.cmdline, flavour.marker, info)
