"""A file of this host lent to a running guest as a hot-plugged virtio disk, for moving big files in or out
at disk speed (a pod image: the guest agent's channel carries ~1.6 MiB/s in under TCG, a disk ~25 MiB/s).

    with HotDisk(domain, path, writable=False) as disk:
        guest_shell(f"head -c {size} {disk.guest_device} > /var/lib/pods/in/x")

The disk is raw, attached live only (never in the domain's saved config), named in the guest by a serial
of its own (``/dev/disk/by-id/virtio-<serial>``), and detached on the way out — before anything can
suspend the guest, whose restore XML admits only its own disks. Attach and detach wait for the guest
(ACPI hot-plug on the ``pc`` machine) within deadlines; a guest that does not take or give back the disk
raises :class:`HotDiskUnavailable` (callers fall back to the agent's channel)."""

from __future__ import annotations

import secrets
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from xml.sax.saxutils import quoteattr

import libvirt

from capsule.errors import EnvironmentProblem, RuntimeFailure
from capsule.runtime import guestaccess

ATTACH_TIMEOUT = 20.0
DETACH_TIMEOUT = 30.0
# the guest is asked for the device at 10, 20, 40 … ms, then every 200 ms: a TCG guest shows it ~0.05–0.1 s
# after the attach, where a flat 200 ms poll made every copy wait a fifth of a second more than it needed
FIRST_POLL, LAST_POLL = 0.01, 0.2
SECTOR = 512


class HotDiskUnavailable(RuntimeFailure):
    """The guest did not take a hot-plugged disk (or libvirt refused to attach one)."""

    code = "hot_disk_unavailable"


def _free_target(domain_xml: str) -> str:
    taken = {t.get("dev") for t in ET.fromstring(domain_xml).iter("target") if t.get("dev")}
    for letter in "zyxwvutsrq":
        if f"vd{letter}" not in taken:
            return f"vd{letter}"
    raise HotDiskUnavailable("no free virtio disk name (vdq … vdz) to lend a file to the guest under")


class HotDisk:
    """``path`` lent to the running ``domain`` as a raw virtio disk, read-only unless ``writable``. The
    guest sees its size rounded up to a whole sector (the bytes past the file read as zero).
    ``guest_has(device)`` is asked (e.g. through the guest agent) until the device node is there."""

    def __init__(self, domain: libvirt.virDomain, path: Path, guest_has: Callable[[str], bool], *,
                 writable: bool = False) -> None:
        self.domain = domain
        self.path = Path(path)
        self.serial = "cap" + secrets.token_hex(6)   # virtio-blk serials are at most 20 bytes
        self.guest_device = f"/dev/disk/by-id/virtio-{self.serial}"
        self._guest_has = guest_has
        self._writable = writable
        # a write error (the host's file system full) is the guest's I/O error, never a paused guest
        self._xml = (f"<disk type='file' device='disk'><driver name='qemu' type='raw' error_policy='report'/>"
                     f"<source file={quoteattr(str(self.path))}/>"
                     f"<target dev='{_free_target(domain.XMLDesc(0))}' bus='virtio'/>"
                     f"{'' if writable else '<readonly/>'}<serial>{self.serial}</serial></disk>")
        self._attached = False

    def __enter__(self) -> HotDisk:
        try:
            guestaccess.lend(self.path, writable=self._writable)
        except (EnvironmentProblem, OSError) as exc:
            raise HotDiskUnavailable(f"{self.path.name} cannot be lent to the guest: {exc}") from exc
        try:
            self.domain.attachDeviceFlags(self._xml, libvirt.VIR_DOMAIN_AFFECT_LIVE)
        except libvirt.libvirtError as exc:
            raise HotDiskUnavailable(f"libvirt would not attach {self.path.name} to the guest: "
                                     f"{exc.get_error_message()}") from exc
        self._attached = True
        deadline = time.monotonic() + ATTACH_TIMEOUT
        pause = FIRST_POLL
        while not self._guest_has(self.guest_device):
            if time.monotonic() > deadline:
                self._detach()
                raise HotDiskUnavailable(f"the guest did not see a hot-plugged disk within {ATTACH_TIMEOUT:.0f} s "
                                         "(no ACPI PCI hot-plug in its kernel?)")
            time.sleep(pause)
            pause = min(2 * pause, LAST_POLL)
        return self

    def __exit__(self, *exc: object) -> None:
        self._detach()

    def _present(self) -> bool:
        return self.serial in self.domain.XMLDesc(0)

    def _detach(self) -> None:
        if not self._attached:
            return
        try:
            self.domain.detachDeviceFlags(self._xml, libvirt.VIR_DOMAIN_AFFECT_LIVE)
        except libvirt.libvirtError as exc:
            if self._present():
                raise RuntimeFailure(f"could not detach the lent disk {self.serial} from the guest: "
                                     f"{exc.get_error_message()}") from exc
        deadline = time.monotonic() + DETACH_TIMEOUT
        while self._present():
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"the guest did not give back the lent disk {self.serial} within "
                                     f"{DETACH_TIMEOUT:.0f} s; it stays attached until the capsule stops")
            time.sleep(0.2)
        self._attached = False


def scratch_file(path: Path, size: int) -> Path:
    """An empty sparse file of at least ``size`` bytes, whole sectors, for the guest to write into."""
    with path.open("wb") as f:
        f.truncate(max(SECTOR, -(-size // SECTOR) * SECTOR))
    return path
