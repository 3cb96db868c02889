"""libvirt domain XML for a capsule instance: this host's template, used to
boot and (with what a memory image's saved state requires, see
``restorexml``) to restore."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from capsule.runtime.guestaccess import seclabel

AGENT_CHANNEL = "org.capsule.agent.0"


@dataclass
class MachineSpec:
    name: str            # libvirt domain name
    uuid: str
    memory_mib: int
    vcpus: int
    accel: str           # "kvm" or "tcg"
    kernel: Path
    initrd: Path
    cmdline: str
    disks: list[Path]    # leaf layers, vda, vdb, …
    console_log: Path
    agent_socket: Path
    free_page_reporting: bool = True
    emulator: str | None = None   # None: libvirt's default
    vnc_socket: Path | None = None  # the screen: a VGA card and a VNC server on this unix socket; None: no screen
    user_network: str | None = None  # "ADDRESS/PREFIX": a virtio NIC on QEMU's user-mode network (outbound only)
    pod_uplink: tuple[str, str] | None = None  # (bridge, MAC): a virtio NIC on the host's pod bridge (podnet)
    # disk index -> the unix socket of the disk server its leaf stands on (demand paging, ``diskserver``)
    disk_servers: dict[int, Path] = field(default_factory=dict)


# seconds QEMU's NBD client waits for a disk server that went away (the instance's watcher starts a dead one
# again within a second or two) before a read fails and the guest pauses (error policy ``stop``)
NBD_RECONNECT_DELAY = 15


def add_disk_server_backing(disk: ET.Element, socket: Path) -> None:
    """The leaf's backing, the disk server's raw NBD export, named in the XML rather than left to libvirt to
    read from the leaf's header: only here can QEMU be told to reconnect to a server that died."""
    bs = ET.SubElement(disk, "backingStore", type="network")
    ET.SubElement(bs, "format", type="raw")
    src = ET.SubElement(bs, "source", protocol="nbd")
    ET.SubElement(src, "host", transport="unix", socket=str(socket))
    ET.SubElement(src, "reconnect", delay=str(NBD_RECONNECT_DELAY))
    ET.SubElement(bs, "backingStore")


def _disk_target(i: int) -> str:
    return "vd" + chr(ord("a") + i)


def screen_cmdline(cmdline: str) -> str:
    """The kernel also writes to the screen (tty0); the serial port stays /dev/console (the last console=)."""
    if re.search(r"(^|\s)console=tty0(\s|$)", cmdline):
        return cmdline
    return f"console=tty0 {cmdline}"


def add_screen(devices: ET.Element, vnc_socket: Path) -> None:
    """A standard VGA card (text mode from the BIOS on: any kernel shows its console there without a driver)
    and its VNC server, on a unix socket in the instance's directory only: never a TCP port. Plus an absolute
    pointer (:func:`add_pointer`)."""
    graphics = ET.SubElement(devices, "graphics", type="vnc", socket=str(vnc_socket))
    ET.SubElement(graphics, "listen", type="socket", socket=str(vnc_socket))
    video = ET.SubElement(devices, "video")
    ET.SubElement(video, "model", type="vga", vram="16384", heads="1", primary="yes")
    add_pointer(devices)


def add_pointer(devices: ET.Element) -> None:
    """An absolute pointing device (virtio-tablet-pci): QEMU's VNC server then hands it the client's pointer
    position as it is, so the guest's pointer sits exactly under the browser's; with only the PS/2 mouse QEMU
    makes relative moves of it and the guest's acceleration makes the two drift apart. Virtio rather than a USB
    tablet: a USB device keeps the UHCI controller's 1 kHz frame timer running, which costs a TCG guest CPU
    while it idles. Both are migratable (the device has its vmstate); a guest without ``virtio_input`` keeps
    the PS/2 mouse."""
    ET.SubElement(devices, "input", type="tablet", bus="virtio")


def add_user_network(devices: ET.Element, network: str) -> None:
    """A virtio NIC on QEMU's user-mode network (slirp: NAT inside the QEMU process, outbound connections
    only, nothing on the host's own network). ``network`` is the guest side's ``ADDRESS/PREFIX``: the
    gateway is its .2, the DNS forwarder its .3, the guest takes .15 (slirp's layout)."""
    address, _, prefix = network.partition("/")
    nic = ET.SubElement(devices, "interface", type="user")
    ET.SubElement(nic, "ip", family="ipv4", address=address, prefix=prefix or "24")
    ET.SubElement(nic, "model", type="virtio")


def add_pod_uplink(devices: ET.Element, bridge: str, mac: str) -> None:
    """A virtio NIC on the host's pod bridge (``capsule.runtime.podnet``); the guest's pods0 enslaves it."""
    nic = ET.SubElement(devices, "interface", type="bridge")
    ET.SubElement(nic, "mac", address=mac)
    ET.SubElement(nic, "source", bridge=bridge)
    ET.SubElement(nic, "model", type="virtio")


def build(spec: MachineSpec) -> str:
    dom = ET.Element("domain", type="kvm" if spec.accel == "kvm" else "qemu")
    ET.SubElement(dom, "name").text = spec.name
    ET.SubElement(dom, "uuid").text = spec.uuid
    ET.SubElement(dom, "memory", unit="MiB").text = str(spec.memory_mib)
    ET.SubElement(dom, "currentMemory", unit="MiB").text = str(spec.memory_mib)
    ET.SubElement(dom, "vcpu").text = str(spec.vcpus)
    os_el = ET.SubElement(dom, "os")
    ET.SubElement(os_el, "type", arch="x86_64", machine="pc").text = "hvm"
    ET.SubElement(os_el, "kernel").text = str(spec.kernel)
    ET.SubElement(os_el, "initrd").text = str(spec.initrd)
    ET.SubElement(os_el, "cmdline").text = screen_cmdline(spec.cmdline) if spec.vnc_socket else spec.cmdline
    features = ET.SubElement(dom, "features")
    ET.SubElement(features, "acpi")
    if spec.accel == "kvm":
        ET.SubElement(dom, "cpu", mode="host-model")
    else:
        # a named, host-independent model keeps TCG memory images portable between hosts
        cpu = ET.SubElement(dom, "cpu", mode="custom", match="exact")
        ET.SubElement(cpu, "model", fallback="allow").text = "qemu64"
    ET.SubElement(dom, "on_poweroff").text = "destroy"
    ET.SubElement(dom, "on_reboot").text = "restart"
    ET.SubElement(dom, "on_crash").text = "destroy"
    devices = ET.SubElement(dom, "devices")
    if spec.emulator:
        ET.SubElement(devices, "emulator").text = spec.emulator
    for i, disk in enumerate(spec.disks):
        d = ET.SubElement(devices, "disk", type="file", device="disk")
        ET.SubElement(d, "driver", name="qemu", type="qcow2", cache="writeback",
                      error_policy="stop", rerror_policy="stop", discard="unmap")
        ET.SubElement(d, "source", file=str(disk))
        if i in spec.disk_servers:
            add_disk_server_backing(d, spec.disk_servers[i])
        ET.SubElement(d, "target", dev=_disk_target(i), bus="virtio")
    serial = ET.SubElement(devices, "serial", type="pty")
    ET.SubElement(serial, "log", file=str(spec.console_log), append="on")
    ET.SubElement(serial, "target", port="0")
    console = ET.SubElement(devices, "console", type="pty")
    ET.SubElement(console, "target", type="serial", port="0")
    ET.SubElement(devices, "controller", type="virtio-serial", index="0")
    channel = ET.SubElement(devices, "channel", type="unix")
    ET.SubElement(channel, "source", mode="bind", path=str(spec.agent_socket))
    ET.SubElement(channel, "target", type="virtio", name=AGENT_CHANNEL)
    if spec.user_network is not None:
        add_user_network(devices, spec.user_network)
    if spec.pod_uplink is not None:
        add_pod_uplink(devices, *spec.pod_uplink)
    if spec.vnc_socket is not None:
        add_screen(devices, spec.vnc_socket)
    balloon = ET.SubElement(devices, "memballoon", model="virtio",
                            freePageReporting="on" if spec.free_page_reporting else "off")
    ET.SubElement(balloon, "stats", period="0")
    dom.append(seclabel())  # QEMU runs unprivileged; libvirt relabels nothing (runtime/guestaccess.py)
    return ET.tostring(dom, encoding="unicode")
