"""Build the Debian bookworm guest with mmdebstrap and boot it with plain QEMU (TCG) to the marker."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from capsule.imagebuild import MARKER, BuiltImage, build_debian
from capsule.imagebuild.common import agent_binary
from capsule.imagebuild.qemuboot import SerialGuest

pytestmark = [
    pytest.mark.vm,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not all(shutil.which(t) for t in ("qemu-system-x86_64", "mmdebstrap", "mkfs.ext4")),
        reason="needs root, qemu-system-x86_64, mmdebstrap and mkfs.ext4",
    ),
]


def image_cache() -> Path:
    return Path(os.environ.get("CAPSULE_IMAGE_CACHE") or Path.home() / ".cache" / "capsule" / "images")


@pytest.fixture(scope="module")
def debian(tmp_path_factory: pytest.TempPathFactory) -> BuiltImage:
    mp = pytest.MonkeyPatch()
    mp.setenv("CAPSULE_IMAGE_CACHE", str(image_cache()))
    try:
        return build_debian(tmp_path_factory.mktemp("debian") / "out", disk_size="2G", extra_packages=["less"])
    finally:
        mp.undo()


def test_debian_outputs(debian: BuiltImage) -> None:
    assert debian.kind == "debian"
    assert debian.marker == MARKER
    assert debian.cmdline.startswith("root=/dev/vda rw console=ttyS0,115200")
    assert debian.info["kernel_release"].endswith("-cloud-amd64")
    for pkg in ("systemd", "udev", "criu", "python3", "kmod", "initramfs-tools", "less"):
        assert pkg in debian.info["packages"], pkg
    assert {"virtio_pci", "virtio_blk"} <= set(debian.info["initrd_has"])
    st = debian.disk_raw.stat()
    assert st.st_size == 2 * 2**30
    assert st.st_blocks * 512 < st.st_size // 2, "disk.raw should be sparse"
    with debian.disk_raw.open("rb") as f:
        f.seek(1024 + 0x38)
        assert f.read(2) == b"\x53\xef", "ext4 superblock magic at the start of the disk (no partition table)"
    assert debian.info["agent_sha256"] == hashlib.sha256(agent_binary().read_bytes()).hexdigest()
    assert debian.info["agent_path"] == "/usr/local/sbin/capsule-agent"
    names = sorted(p.name for p in debian.kernel.parent.iterdir())
    assert names == ["disk.raw", "initrd.img", "mmdebstrap.log", "vmlinuz"]


def test_debian_boots_to_marker(debian: BuiltImage, tmp_path: Path) -> None:
    with SerialGuest.boot(debian, snapshot=True, memory_mb=512, log_path=tmp_path / "console.log") as g:
        seconds = g.wait_for_marker(debian.marker, timeout=240)
        assert seconds < 240
        # the guest agent answers on its virtio-serial port (capsule-ready.service runs after it started)
        t0 = time.monotonic()
        reply = g.agent_call("ping", timeout=60)
        assert reply["ok"] is True, reply
        assert time.monotonic() - t0 < 30
        assert reply["result"]["version"] == debian.info["agent_version"]
        assert reply["result"]["hostname"] == "capsule-guest"
        first_pid = reply["result"]["pid"]
        g.wait_for_shell(timeout=60)
        assert g.run("id -un") == "root"
        assert g.run("hostname") == "capsule-guest"
        assert g.run("findmnt -no SOURCE,FSTYPE /").split() == ["/dev/vda", "ext4"]
        assert g.run("systemctl is-system-running --wait", timeout=120, check=False) in (
            "running",
            "degraded",
        )
        assert g.run("systemctl is-active capsule-ready.service") == "active"
        assert g.run("systemctl is-enabled apt-daily.timer man-db.timer", check=False).split() == [
            "masked",
            "masked",
        ]
        assert g.run("ls /var/lib/apt/lists | grep -v -x -e partial -e lock | wc -l") == "0"
        assert g.run("python3 -c 'print(6 * 7)'") == "42"
        g.run("criu --version")
        assert "virtio_balloon" in g.run("lsmod")
        # the agent: enabled, supervised by systemd, logging to the journal and not to the console
        assert g.run("systemctl is-enabled capsule-agent.service") == "enabled"
        assert g.run("systemctl is-active capsule-agent.service") == "active"
        g.run("systemctl kill --signal=KILL capsule-agent.service")
        again = g.agent_call("ping", timeout=60)
        assert again["ok"] is True and again["result"]["pid"] != first_pid
        assert int(g.run("journalctl -b -o cat -u capsule-agent.service | grep -c ': opened /dev/'")) >= 2
        # (every agent log line starts with "capsule-agent: "; nothing typed above contains that)
        assert "capsule-agent: " not in g.output, f"agent log on the serial console:\n{g.tail()}"
