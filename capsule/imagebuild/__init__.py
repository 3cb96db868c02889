"""Guest images for Capsule: kernel + initrd + raw root disk, booted by direct kernel boot.

- ``build_tiny``: Debian's cloud kernel and a static busybox initramfs; boots in seconds under TCG.
- ``build_debian``: Debian bookworm with systemd, built by mmdebstrap onto a bare ext4 disk.
- ``build_desktop``: the Debian guest plus a small graphical session (X, JWM, xterm, Dillo) logged in by itself;
  its marker, ``CAPSULE-DESKTOP-READY``, comes once the session is on screen.

All print ``CAPSULE-GUEST-READY`` (``MARKER``) on the serial console (ttyS0) once they are up, and
all run the guest agent (``guest-balloon/capsule-agent``, built on demand by ``agent_binary``) under a
supervisor on the virtio-serial port ``org.capsule.agent.0``; its log never goes to the console.
"""

from .common import AGENT_PORT, MARKER, BuiltImage, ImageBuildError, agent_binary
from .debian import build_debian
from .desktop import DESKTOP_MARKER, build_desktop
from .tiny import build_tiny

__all__ = [
    "AGENT_PORT",
    "DESKTOP_MARKER",
    "MARKER",
    "BuiltImage",
    "ImageBuildError",
    "agent_binary",
    "build_debian",
    "build_desktop",
    "build_tiny",
]
