"""Build the tiny guest and boot it with plain QEMU (TCG), then use its serial root shell."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from capsule.imagebuild import MARKER, BuiltImage, build_tiny
from capsule.imagebuild.common import agent_binary
from capsule.imagebuild.qemuboot import SerialGuest
from capsule.imagebuild.tiny import BLOCK_SIZE, DISK_BYTES, PATTERN_BLOCKS, expected_md5, pattern_block

pytestmark = pytest.mark.vm

needs_tools = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("qemu-system-x86_64", "apt-get", "dpkg-deb")),
    reason="needs qemu-system-x86_64, apt-get and dpkg-deb",
)


def image_cache() -> Path:
    """Keep the kernel .deb between test runs (CAPSULE_IMAGE_CACHE wins)."""
    return Path(os.environ.get("CAPSULE_IMAGE_CACHE") or Path.home() / ".cache" / "capsule" / "images")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> BuiltImage:
    mp = pytest.MonkeyPatch()
    mp.setenv("CAPSULE_IMAGE_CACHE", str(image_cache()))
    try:
        return build_tiny(tmp_path_factory.mktemp("tiny") / "out")
    finally:
        mp.undo()


@pytest.fixture
def guest(tiny: BuiltImage, tmp_path: Path):
    with SerialGuest.boot(tiny, snapshot=True, log_path=tmp_path / "console.log") as g:
        yield g


@needs_tools
def test_tiny_outputs(tiny: BuiltImage) -> None:
    assert tiny.kind == "tiny"
    assert tiny.marker == MARKER
    assert "console=ttyS0,115200" in tiny.cmdline
    for f in (tiny.kernel, tiny.initrd, tiny.disk_raw):
        assert f.is_file() and f.stat().st_size > 0
    assert tiny.initrd.stat().st_size < 8 * 2**20
    st = tiny.disk_raw.stat()
    assert st.st_size == DISK_BYTES
    assert st.st_blocks * 512 < 16 * 2**20, "disk.raw should be sparse"
    with tiny.disk_raw.open("rb") as f:
        assert f.read(BLOCK_SIZE) == pattern_block(0)
        f.seek(7 * BLOCK_SIZE)
        assert f.read(BLOCK_SIZE) == pattern_block(7)
        f.seek(PATTERN_BLOCKS * BLOCK_SIZE)
        assert f.read(BLOCK_SIZE) == bytes(BLOCK_SIZE)
    assert "virtio_blk" in tiny.info["modules_loaded"]
    assert tiny.info["kernel_release"].endswith("-cloud-amd64")
    assert tiny.info["agent_sha256"] == hashlib.sha256(agent_binary().read_bytes()).hexdigest()
    assert re.fullmatch(r"\d+\.\d+\.\d+", tiny.info["agent_version"])
    assert tiny.info["agent_path"] == "/sbin/capsule-agent"
    # work files are cleaned up: only the outputs stay
    assert sorted(p.name for p in tiny.kernel.parent.iterdir()) == ["disk.raw", "initramfs.img", "vmlinuz"]


@needs_tools
def test_tiny_rebuild_uses_cache(tiny: BuiltImage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSULE_IMAGE_CACHE", str(image_cache()))
    msgs: list[str] = []
    again = build_tiny(tmp_path / "again", msgs.append)
    assert not any(m.startswith("downloading") for m in msgs), msgs
    assert again.initrd.read_bytes() == tiny.initrd.read_bytes(), "the initramfs should be reproducible"


@needs_tools
def test_tiny_boots_and_runs_commands(guest: SerialGuest, tiny: BuiltImage) -> None:
    seconds = guest.wait_for_marker(tiny.marker, timeout=60)
    assert seconds < 60
    guest.wait_for_shell(timeout=20)
    assert guest.run("dd if=/dev/vda bs=4096 count=1 2>/dev/null | md5sum").split()[0] == expected_md5(0, 1)
    out = guest.run(f"dd if=/dev/vda bs=4096 count={PATTERN_BLOCKS + 16} 2>/dev/null | md5sum")
    assert out.split()[0] == expected_md5(0, PATTERN_BLOCKS + 16)
    assert guest.run("dd if=/dev/vda bs=4096 skip=42 count=1 2>/dev/null | head -c 32") == (
        "CAPSULE-TINY-DISK block #000042"
    )
    # write, sync, read back
    guest.run("echo capsule-was-here > /tmp/x; dd if=/tmp/x of=/dev/vda bs=4096 seek=2000 conv=notrunc,fsync")
    guest.run("echo 3 > /proc/sys/vm/drop_caches")
    readback = guest.run("dd if=/dev/vda bs=4096 skip=2000 count=1 2>/dev/null | head -c 16")
    assert readback == "capsule-was-here"
    # the tools tests rely on, and job control
    for applet in ("dd", "md5sum", "sha256sum", "sleep", "cat", "echo", "sync", "uptime", "free"):
        guest.run(f"command -v {applet}")
    assert "Done" in guest.run("sleep 0.2 & jobs; wait; jobs")
    assert "virtio_balloon" in guest.run("lsmod")
    assert guest.run("cat /sys/block/vda/size") == str(DISK_BYTES // 512)
    # a failing command reports its status
    assert guest.run("false", check=False) == ""


@needs_tools
def test_tiny_shell_respawns(guest: SerialGuest, tiny: BuiltImage) -> None:
    guest.wait_for_marker(tiny.marker, timeout=60)
    guest.wait_for_shell(timeout=20)
    guest.send("exit\n")
    guest.wait_for_shell(timeout=20)
    assert guest.run("echo $((6 * 7))") == "42"


@needs_tools
def test_tiny_agent_answers_on_virtio_serial(guest: SerialGuest, tiny: BuiltImage) -> None:
    guest.wait_for_marker(tiny.marker, timeout=60)
    t0 = time.monotonic()
    reply = guest.agent_call("ping", timeout=30)
    assert reply["ok"] is True, reply
    assert time.monotonic() - t0 < 10, "the agent should answer within seconds of the marker"
    ping = reply["result"]
    assert ping["version"] == tiny.info["agent_version"]
    assert ping["protocol"] == 1 and ping["hostname"] == "capsule-tiny"
    assert ping["kernel"] == tiny.info["kernel_release"]
    first_pid = ping["pid"]
    # a second connection works too (the agent notices the host going and coming back)
    assert guest.agent_call("stats")["result"]["MemTotal"] > 100 * 2**20
    # supervised: killed, busybox init starts it again
    guest.wait_for_shell(timeout=20)
    guest.run("kill $(pidof capsule-agent)")
    again = guest.agent_call("ping", timeout=30)
    assert again["ok"] is True and again["result"]["pid"] != first_pid
    # it logs to /run, not to the console the host types into
    assert int(guest.run("grep -c 'opened /dev/vport' /run/capsule-agent.log")) >= 2
    assert int(guest.run("grep -c terminated /run/capsule-agent.log")) == 1
    # (every agent log line starts with "capsule-agent: "; nothing typed above contains that)
    assert "capsule-agent: " not in guest.output, f"agent log on the serial console:\n{guest.tail()}"
