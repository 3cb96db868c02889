"""The "desktop" guest: the Debian guest plus a small graphical session on the capsule's screen.

X (Xorg's modesetting driver on the kernel's ``bochs`` DRM driver for the standard VGA card every capsule
has), JWM (window manager with a task bar), xterm and the Dillo browser. The first virtual console logs
user ``user`` in by itself (a getty autologin) and its login shell runs ``startx`` (rootless X through
logind); JWM starts a terminal whose shell first tells a root unit, through a file, that the session is
on screen, and that unit prints ``CAPSULE-DESKTOP-READY`` on the serial console: the image's marker, so
``capsule start`` returns once the desktop is up. The guest agent and the serial root shell are the Debian guest's.

The cloud kernel of the Debian guest has no DRM, no framebuffer for a BIOS-booted VGA card and no PS/2
mouse, so this image carries Debian's generic kernel, minus the module trees no capsule has hardware for
(dpkg path filters: those files are never unpacked), and an initrd with only the modules it needs. Mesa's
3D drivers and LLVM are not unpacked either: X draws in software.
"""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

from .common import BuiltImage, Progress
from .debian import DEBIAN_CMDLINE, Flavour, build_debian, enable_unit, write_file

DESKTOP_MARKER = "CAPSULE-DESKTOP-READY"
"""Line the desktop guest prints on its serial console once its graphical session is on screen."""

USER = "user"
UID = 1000
READY_DIR = "/run/capsule-desktop"
READY_FILE = f"{READY_DIR}/ready"
READY_COMMAND = "/usr/local/bin/capsule-session-ready"
BACKGROUND = "#2d5f8b"
"""The desktop's colour (a solid background: the screen is not a text console's black and grey)."""
HOME_PAGE = "/usr/local/share/capsule-desktop/index.html"

KERNEL_PACKAGE = "linux-image-amd64"
PACKAGES = (
    "xserver-xorg-core",  # Xorg with the modesetting driver
    "xserver-xorg-input-libinput",  # keyboard and mouse
    "xinit",  # startx
    "xauth",  # startx's cookie
    "libpam-systemd",  # a logind session for the autologin: rootless Xorg opens the card and inputs through it
    "jwm",  # window manager + task bar, one small binary
    "xterm",
    "dillo",  # browser (FLTK; no JavaScript): the lightest graphical one in bookworm
    "fonts-dejavu-core",  # the one scalable font family (JWM, Dillo)
    "usr-is-merged",  # the other way to satisfy init-system-helpers, so usrmerge can go (PURGE_USRMERGE)
)

_MODULES = "/lib/modules/*/kernel/"
EXCLUDED_MODULE_TREES = (
    "sound",
    "drivers/media",
    "drivers/net/wireless",
    "drivers/net/ethernet",
    "drivers/net/can",
    "drivers/net/usb",
    "drivers/gpu/drm/amd",
    "drivers/gpu/drm/nouveau",
    "drivers/gpu/drm/i915",
    "drivers/gpu/drm/radeon",
    "drivers/infiniband",
    "drivers/iio",
    "drivers/staging",
    "drivers/isdn",
    "drivers/comedi",
    "drivers/bluetooth",
    "net/wireless",
    "net/mac80211",
    "net/bluetooth",
)
"""Module trees of the generic kernel for hardware a capsule never has (sound, radios, NICs: a capsule's
only devices are virtio, the VGA card and PS/2 input); ~200 MiB never unpacked."""

_LIBS = "/usr/lib/x86_64-linux-gnu/"
EXCLUDED_FILES = (f"{_LIBS}dri/*", f"{_LIBS}libLLVM-15.so*", f"{_LIBS}libz3.so*")
"""Mesa's DRI drivers and the LLVM (and z3) only they link: Xorg depends on Mesa, but the VGA card has no 3D
and X draws in software (modesetting without glamor, ``XORG_CONF``); ~160 MiB never unpacked."""

PERL_FOR_USRMERGE = ("usrmerge", "libfile-find-rule-perl", "libnumber-compare-perl", "libtext-glob-perl",
                     "perl", "libperl5.36", "perl-modules-5.36")
PURGE_USRMERGE = "dpkg --purge " + " ".join(PERL_FOR_USRMERGE)
"""The essential set's init-system-helpers needs "usrmerge | usr-is-merged"; apt picks usrmerge, and with it
perl (~50 MiB), though the tree is merged already. With usr-is-merged installed too, nothing here needs them
(dpkg refuses to purge a package another one depends on, so the build would stop)."""

INITRD_MODULES = ("ext4", "crc32c_generic")
"""The generic kernel has ext4 as a module; with MODULES=list the initrd holds only these and the virtio ones."""
LOADED_MODULES = ("bochs", "evdev")
"""Loaded at boot by systemd-modules-load, so the card's /dev/dri/card0 is there early (udev would load them
too, but later)."""

AUTOLOGIN_TTY1 = f"""[Service]
ExecStart=
ExecStart=-/sbin/agetty --autologin {USER} --noclear %I $TERM
"""

XORG_CONF = """# Capsule desktop: the VGA card through the kernel's bochs DRM driver, drawn in software (no glamor: no
# 3D, and Mesa's drivers are not installed); the screen never blanks (a console shows a live session).
Section "ServerFlags"
    Option "BlankTime" "0"
    Option "StandbyTime" "0"
    Option "SuspendTime" "0"
    Option "OffTime" "0"
EndSection

Section "Device"
    Identifier "capsule-vga"
    Driver "modesetting"
    Option "AccelMethod" "none"
EndSection

# The PS/2 mouse gets relative moves that QEMU makes from a VNC client's absolute pointer: without
# acceleration the guest's pointer stays under the client's.
Section "InputClass"
    Identifier "capsule-pointer"
    MatchIsPointer "on"
    Driver "libinput"
    Option "AccelProfile" "flat"
EndSection
"""

PROFILE_SCRIPT = f"""# Capsule desktop: the autologin on the first virtual console starts the graphical session.
if [ -z "$DISPLAY" ] && [ "$(id -u)" = {UID} ] && [ "$(tty)" = /dev/tty1 ]; then
    # the card's DRM device (bochs) may still be on its way
    i=0
    while [ ! -e /dev/dri/card0 ] && [ "$i" -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
    exec startx -- -nolisten tcp
fi
"""

READY_SCRIPT = f"""#!/bin/sh
# Capsule desktop: the first terminal of the session runs this once its window is up; a root unit tells the host.
: > {READY_FILE}
"""
FIRST_TERMINAL = f"xterm -T Terminal -e sh -c '{READY_COMMAND}; exec bash'"
"""JWM starts it once it is up: the session's first terminal, whose shell first says the session is ready
(so the marker comes with the task bar and a terminal on screen)."""

TMPFILES = f"d {READY_DIR} 0755 {USER} {USER} -\n"

READY_PATH_UNIT = f"""[Unit]
Description=Wait for the desktop session to be on screen

[Path]
PathExists={READY_FILE}

[Install]
WantedBy=multi-user.target
"""

READY_SERVICE_UNIT = f"""[Unit]
Description=Tell the host on the serial console that the desktop session is on screen

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'printf "\\\\r\\\\n{DESKTOP_MARKER}\\\\r\\\\n" > /dev/ttyS0'
"""

HOME_HTML = """<!DOCTYPE html>
<html><head><title>Capsule desktop</title></head>
<body>
<h1>Capsule desktop</h1>
<p>A small Debian desktop in a capsule: JWM, xterm and this browser (Dillo).
Suspend it, move it to another host, and it carries on where it was.</p>
</body></html>
"""

DILLORC = f"""# Capsule desktop: the start page is on the disk (a capsule has no network card)
start_page="file:{HOME_PAGE}"
home="file:{HOME_PAGE}"
"""


def jwmrc(background: str = BACKGROUND, terminal: str = "xterm", browser: str = "dillo",
          startup: str = FIRST_TERMINAL) -> str:
    """JWM's configuration: a root menu, a task bar (menu, terminal, browser, windows, clock), a solid
    background; ``startup`` run once JWM is up."""
    t, b = escape(terminal), escape(browser)
    return f"""<?xml version="1.0"?>
<JWM>
    <StartupCommand>{escape(startup)}</StartupCommand>
    <RootMenu onroot="123" label="Capsule">
        <Program label="Terminal">{t}</Program>
        <Program label="Browser">{b}</Program>
        <Separator/>
        <Restart label="Restart JWM"/>
        <Exit label="Log out" confirm="true"/>
    </RootMenu>
    <Tray x="0" y="-1" height="28" autohide="off">
        <TrayButton label="Menu">root:1</TrayButton>
        <TrayButton label="Terminal">exec:{t}</TrayButton>
        <TrayButton label="Browser">exec:{b}</TrayButton>
        <TaskList maxwidth="240"/>
        <Clock format="%H:%M"/>
    </Tray>
    <Desktops width="1" height="1">
        <Background type="solid">{escape(background)}</Background>
    </Desktops>
    <WindowStyle>
        <Font>DejaVu Sans-10</Font>
        <Active><Background>#4a7ab0</Background><Foreground>white</Foreground></Active>
        <Foreground>#d0d0d0</Foreground><Background>#555555</Background>
    </WindowStyle>
    <TrayStyle>
        <Font>DejaVu Sans-10</Font>
        <Background>#333333</Background><Foreground>white</Foreground>
    </TrayStyle>
    <MenuStyle>
        <Font>DejaVu Sans-10</Font>
        <Background>#333333</Background><Foreground>white</Foreground>
    </MenuStyle>
    <FocusModel>click</FocusModel>
</JWM>
"""


def config_files() -> dict[str, tuple[str, int]]:
    """The files the desktop writes into the tree: path → (text, mode)."""
    return {
        "/etc/systemd/system/getty@tty1.service.d/autologin.conf": (AUTOLOGIN_TTY1, 0o644),
        "/etc/profile.d/capsule-desktop.sh": (PROFILE_SCRIPT, 0o644),
        "/etc/X11/xorg.conf.d/10-capsule.conf": (XORG_CONF, 0o644),
        "/etc/jwm/system.jwmrc": (jwmrc(), 0o644),
        READY_COMMAND: (READY_SCRIPT, 0o755),
        "/etc/tmpfiles.d/capsule-desktop.conf": (TMPFILES, 0o644),
        "/etc/systemd/system/capsule-desktop-ready.path": (READY_PATH_UNIT, 0o644),
        "/etc/systemd/system/capsule-desktop-ready.service": (READY_SERVICE_UNIT, 0o644),
        "/etc/modules-load.d/capsule-desktop.conf": ("".join(m + "\n" for m in LOADED_MODULES), 0o644),
        "/etc/dillo/dillorc": (DILLORC, 0o644),
        HOME_PAGE: (HOME_HTML, 0o644),
    }


def configure_desktop(root: Path) -> None:
    for path, (text, mode) in config_files().items():
        write_file(root / path.lstrip("/"), text, mode)
    system = root / "etc/systemd/system"
    enable_unit(system, "capsule-desktop-ready.path")
    # the first virtual console's getty (its autologin starts the session), whatever the presets did
    wants = system / "getty.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / "getty@tty1.service"
    if not link.is_symlink():
        link.symlink_to("/lib/systemd/system/getty@.service")


DESKTOP = Flavour(
    kind="desktop",
    kernel_package=KERNEL_PACKAGE,
    packages=PACKAGES,
    dpkg_excludes=tuple(f"path-exclude={path}" for path in (
        *(f"{_MODULES}{tree}/*" for tree in EXCLUDED_MODULE_TREES), *EXCLUDED_FILES)),
    initrd_modules=INITRD_MODULES,
    initrd_modules_only=True,
    chroot_commands=(PURGE_USRMERGE,
                     f"useradd --create-home --uid {UID} --shell /bin/bash --groups video,input,audio {USER}"),
    configure=configure_desktop,
    cmdline=DEBIAN_CMDLINE,
    marker=DESKTOP_MARKER,
)


def build_desktop(workdir: Path, progress: Progress | None = None, disk_size: str = "3G") -> BuiltImage:
    """Build the desktop guest: the Debian guest's builder with the ``DESKTOP`` flavour."""
    return build_debian(workdir, progress, disk_size=disk_size, flavour=DESKTOP)
