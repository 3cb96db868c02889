"""The desktop image's pure parts: its flavour of the Debian builder (packages, kernel, dpkg filters, initrd
modules) and the files it writes into the tree (autologin, session start, JWM, the ready path)."""

from __future__ import annotations

import fnmatch
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capsule import images
from capsule.cli.main import app
from capsule.imagebuild import debian, desktop
from capsule.imagebuild.debian import BASE_PACKAGES, DEBIAN, INITRD_MODULES, READY_UNIT

pytestmark = pytest.mark.unit


def test_desktop_is_the_debian_guest_plus_a_session() -> None:
    pkgs = desktop.DESKTOP.all_packages()
    assert len(pkgs) == len(set(pkgs))
    assert set(BASE_PACKAGES) <= set(pkgs), "everything the Debian guest has"
    for p in ("xserver-xorg-core", "xserver-xorg-input-libinput", "xinit", "jwm", "xterm", "dillo"):
        assert p in pkgs
    # the generic kernel (DRM for the VGA card, PS/2 mouse), not the cloud one
    assert "linux-image-amd64" in pkgs and "linux-image-cloud-amd64" not in pkgs
    assert "linux-image-cloud-amd64" in DEBIAN.all_packages() and "xinit" not in DEBIAN.all_packages()
    assert DEBIAN.all_packages(["less"])[-1] == "less"
    assert desktop.DESKTOP.marker == desktop.DESKTOP_MARKER != DEBIAN.marker
    assert desktop.DESKTOP.kind == "desktop" and DEBIAN.kind == "debian"
    # in the chroot: usrmerge (and the perl it brings) purged first, then the session's user made
    first, second = desktop.DESKTOP.chroot_commands
    assert first.startswith("dpkg --purge ") and {"usrmerge", "perl"} <= set(first.split()[2:])
    assert second.startswith("useradd ") and second.split()[-1] == desktop.USER and str(desktop.UID) in second
    assert DEBIAN.chroot_commands == ()


def test_initrd_has_the_virtio_modules_and_ext4_only() -> None:
    mods = desktop.DESKTOP.modules()
    assert mods[: len(INITRD_MODULES)] == INITRD_MODULES
    assert "ext4" in mods and len(mods) == len(set(mods))
    assert desktop.DESKTOP.initrd_modules_only and DEBIAN.initrd_modules_only  # both: MODULES=list
    assert DEBIAN.modules() == INITRD_MODULES


def _dpkg_keeps(path: str, filters: tuple[str, ...]) -> bool:
    """dpkg's rule: the last path filter that matches decides (fnmatch, `*` crosses `/`)."""
    keep = True
    for f in filters:
        kind, _, pattern = f.partition("=")
        if fnmatch.fnmatchcase(path, pattern):
            keep = kind == "path-include"
    return keep


@pytest.mark.parametrize(("path", "kept"), [
    ("/lib/modules/6.1.0-56-amd64/kernel/sound/core/snd.ko", False),
    ("/lib/modules/6.1.0-56-amd64/kernel/drivers/gpu/drm/amd/amdgpu/amdgpu.ko", False),
    ("/lib/modules/6.1.0-56-amd64/kernel/drivers/net/wireless/intel/iwlwifi/iwlwifi.ko", False),
    ("/lib/modules/6.1.0-56-amd64/kernel/drivers/gpu/drm/tiny/bochs.ko", True),
    ("/lib/modules/6.1.0-56-amd64/kernel/drivers/gpu/drm/drm.ko", True),
    ("/lib/modules/6.1.0-56-amd64/kernel/drivers/input/evdev.ko", True),
    ("/lib/modules/6.1.0-56-amd64/kernel/drivers/input/mouse/psmouse.ko", True),
    ("/lib/modules/6.1.0-56-amd64/kernel/drivers/net/virtio_net.ko", True),
    ("/lib/modules/6.1.0-56-amd64/kernel/drivers/block/virtio_blk.ko", True),
    ("/lib/modules/6.1.0-56-amd64/kernel/fs/ext4/ext4.ko", True),
    ("/usr/share/doc/xterm/copyright", True),
    ("/usr/lib/x86_64-linux-gnu/dri/swrast_dri.so", False),
    ("/usr/lib/x86_64-linux-gnu/libLLVM-15.so.1", False),
    ("/usr/lib/x86_64-linux-gnu/libz3.so.4", False),
    ("/usr/lib/x86_64-linux-gnu/libgbm.so.1.0.0", True),
    ("/usr/lib/xorg/modules/drivers/modesetting_drv.so", True),
    ("/usr/share/man/man1/xterm.1.gz", False),
])
def test_dpkg_filters_drop_hardware_a_capsule_lacks(path: str, kept: bool) -> None:
    filters = (*debian.DPKG_EXCLUDES, *desktop.DESKTOP.dpkg_excludes)
    assert _dpkg_keeps(path, filters) is kept


def test_jwmrc_is_xml_that_starts_a_terminal_that_says_ready() -> None:
    root = ET.fromstring(desktop.jwmrc(background="#123456", terminal="xterm -e 'a&b'", startup="go <now>"))
    assert root.tag == "JWM"
    assert [e.text for e in root.iter("StartupCommand")] == ["go <now>"]
    default = ET.fromstring(desktop.jwmrc())
    assert [e.text for e in default.iter("StartupCommand")] == [desktop.FIRST_TERMINAL]
    assert desktop.FIRST_TERMINAL.startswith("xterm ") and f"'{desktop.READY_COMMAND}; exec bash'" in \
        desktop.FIRST_TERMINAL
    assert root.find("./Desktops/Background").text == "#123456"
    assert root.find("./Desktops/Background").get("type") == "solid"
    programs = {e.get("label"): e.text for e in root.iter("Program")}
    assert programs == {"Terminal": "xterm -e 'a&b'", "Browser": "dillo"}
    assert root.find("./Tray/TaskList") is not None


def test_ready_unit_prints_the_desktop_marker_like_the_guest_marker() -> None:
    def exec_line(unit: str) -> str:
        return next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))

    assert exec_line(desktop.READY_SERVICE_UNIT) == exec_line(READY_UNIT).replace(
        debian.MARKER, desktop.DESKTOP_MARKER)
    assert f"PathExists={desktop.READY_FILE}" in desktop.READY_PATH_UNIT
    assert desktop.READY_FILE.startswith(desktop.READY_DIR + "/")
    assert desktop.TMPFILES.split()[:5] == ["d", desktop.READY_DIR, "0755", desktop.USER, desktop.USER]
    assert desktop.READY_FILE in desktop.READY_SCRIPT


def test_session_starts_on_tty1_for_the_autologin_user_only() -> None:
    assert f"--autologin {desktop.USER} " in desktop.AUTOLOGIN_TTY1
    assert desktop.AUTOLOGIN_TTY1.splitlines()[1] == "ExecStart="  # the packaged ExecStart is cleared first
    prof = desktop.PROFILE_SCRIPT
    assert f'"$(id -u)" = {desktop.UID}' in prof and "/dev/tty1" in prof and "exec startx" in prof
    assert desktop.HOME_PAGE in desktop.DILLORC


def test_configure_desktop_writes_its_files(tmp_path: Path) -> None:
    desktop.configure_desktop(tmp_path)
    desktop.configure_desktop(tmp_path)  # again: idempotent
    for path, (text, mode) in desktop.config_files().items():
        f = tmp_path / path.lstrip("/")
        assert f.read_text() == text, path
        assert f.stat().st_mode & 0o777 == mode, path
    system = tmp_path / "etc/systemd/system"
    assert os.readlink(system / "multi-user.target.wants/capsule-desktop-ready.path") == \
        "/etc/systemd/system/capsule-desktop-ready.path"
    assert os.readlink(system / "getty.target.wants/getty@tty1.service") == "/lib/systemd/system/getty@.service"
    assert (tmp_path / "etc/modules-load.d/capsule-desktop.conf").read_text().split() == ["bochs", "evdev"]


def test_desktop_is_an_image_kind_with_a_bigger_disk() -> None:
    assert "desktop" in images.KINDS
    assert images.DEFAULT_DISK_SIZE["desktop"] == "3G"


def test_image_build_help_teaches_desktop() -> None:
    out = CliRunner().invoke(app, ["image", "build", "--help"], terminal_width=200).output
    assert "desktop" in out and "JWM" in out and "capsule image build desktop" in out


def test_xorg_conf_draws_in_software_never_blanks_and_keeps_the_pointer_flat() -> None:
    conf = desktop.XORG_CONF
    lines = [ln.strip() for ln in conf.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    sections = [ln.split()[1].strip('"') for ln in lines if ln.startswith("Section ")]
    assert sections == ["ServerFlags", "Device", "InputClass"]
    assert lines.count("EndSection") == len(sections)
    for option in ("BlankTime", "StandbyTime", "SuspendTime", "OffTime"):
        assert f'Option "{option}" "0"' in lines
    assert 'Driver "modesetting"' in lines and 'Option "AccelMethod" "none"' in lines
    assert 'Option "AccelProfile" "flat"' in lines
