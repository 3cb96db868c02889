"""Guest images for Capsule: kernel + initrd + raw root disk, booted by direct kernel boot.

- ``build_tiny``: Debian's cloud kernel and a static busybox initramfs; boots in seconds under TCG.
- ``build_debian``: Debian bookworm with systemd, built by mmdebstrap onto a bare ext4 disk.

Both print ``CAPSULE-GUEST-READY`` (``MARKER``) on the serial console (ttyS0) once they are up.
"""

from .common import MARKER, BuiltImage, ImageBuildError
from .debian import build_debian
from .tiny import build_tiny

__all__ = ["MARKER", "BuiltImage", "ImageBuildError", "build_debian", "build_tiny"]
