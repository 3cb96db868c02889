"""The domain XML a memory image is restored with: rebuilt from this host's template.

A memory image carries the domain XML of the host that saved it: that host's paths (kernel, initrd, leaves,
console log, agent socket, emulator) and whatever that host, or a hostile peer, put there. It is never
restored as it is. The XML is built from this host's template (:func:`domainxml.build`) and the version's
machine config, and only what the saved device state requires comes from the image: the domain type, the
machine type, the CPU model, the memory sizes, the features, the clock, and each device's address (plus the
few implicit devices libvirt adds itself, which carry no host path).

Before that, every element and attribute of the image's XML is checked against an allow-list; anything else
(a hostdev, a filesystem, another emulator, an extra disk, a network interface other than the pod uplink on the
host's pod bridge, qemu:commandline other than a live move's recovery monitor, ...) is refused with an
:class:`IntegrityError` naming it.
"""

from __future__ import annotations

import copy
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace

from capsule.errors import IntegrityError
from capsule.runtime.domainxml import AGENT_CHANNEL, MachineSpec, build
from capsule.runtime.podnet import BRIDGE as POD_BRIDGE
from capsule.runtime.qmp import MONITOR
from pods.names import UPLINK_MAC_PREFIX


@dataclass(frozen=True)
class Node:
    """What the allow-list accepts for one element: its attributes (name → a pattern its value must fully match,
    or None when the value is never used), its text (a pattern, or None when never used) and its children."""

    attrs: dict[str, str | None] = field(default_factory=dict)
    text: str | None = None
    children: dict[str, Node] = field(default_factory=dict)
    opaque: bool = False     # a template device we do not model: its content is never used, only its address


_NUM = r"[0-9]{1,9}"
_HEX = r"(0x[0-9a-fA-F]{1,8}|[0-9]{1,9})"
_ID = r"[A-Za-z0-9_.+-]{1,64}"
_ONOFF = r"on|off"
_IGNORED = Node(attrs={"*": None}, opaque=True)  # a host-side detail (a path, a pty): never used
ADDRESS = Node(attrs={"type": r"pci|virtio-serial|drive|isa", "domain": _HEX, "bus": _HEX, "slot": _HEX,
                      "function": _HEX, "multifunction": _ONOFF, "controller": _NUM, "target": _NUM,
                      "unit": _NUM, "port": _NUM, "iobase": _HEX, "irq": _HEX})
_ALIAS = Node(attrs={"name": _ID})
_DEV = {"address": ADDRESS, "alias": _ALIAS}

DEVICES: dict[str, Node] = {
    "emulator": Node(text=r"/[A-Za-z0-9_./+-]{1,255}"),   # must also be this host's emulator
    "disk": Node(attrs={"type": "file", "device": "disk"}, children={
        "driver": Node(attrs={"*": None}), "source": _IGNORED, "backingStore": _IGNORED,
        "target": Node(attrs={"dev": r"vd[a-p]", "bus": "virtio"}), **_DEV}),
    "controller": Node(attrs={"type": r"virtio-serial|pci|usb|ide", "index": _NUM,
                              "model": r"pci-root|piix3-uhci|none", "ports": _NUM, "vectors": _NUM},
                       children=dict(_DEV)),
    "serial": Node(attrs={"type": "pty"}, children={
        "source": _IGNORED, "log": _IGNORED,
        "target": Node(attrs={"type": "isa-serial", "port": "0"},
                       children={"model": Node(attrs={"name": "isa-serial"})}),
        **_DEV}),
    "console": Node(attrs={"type": "pty", "tty": None}, children={
        "source": _IGNORED, "log": _IGNORED, "target": Node(attrs={"type": "serial", "port": "0"}), **_DEV}),
    "channel": Node(attrs={"type": "unix"}, children={
        "source": _IGNORED,
        "target": Node(attrs={"type": "virtio", "name": re.escape(AGENT_CHANNEL), "state": r"connected|disconnected"}),
        **_DEV}),
    # PS/2 (libvirt's implicit ones) and the screen's absolute pointer (``domainxml.add_pointer``)
    "input": Node(attrs={"type": r"mouse|keyboard|tablet", "bus": r"ps2|virtio"}, children=dict(_DEV)),
    # the screen: the VNC server's content is this host's (its socket), only the VGA card is device state
    "graphics": Node(attrs={"type": "vnc", "*": None}, opaque=True),
    "video": Node(children={"model": Node(attrs={"type": "vga", "vram": _NUM, "heads": _NUM, "primary": r"yes|no"}),
                            **_DEV}),
    # the pod uplink (``podnet``): only a virtio NIC on the host's pod bridge, with a pod uplink's MAC
    "interface": Node(attrs={"type": "bridge"}, children={
        "mac": Node(attrs={"address": re.escape(UPLINK_MAC_PREFIX) + r"[0-9a-f]{2}:[0-9a-f]{2}:[0-9a-f]{2}"}),
        "source": Node(attrs={"bridge": re.escape(POD_BRIDGE)}), "model": Node(attrs={"type": "virtio"}),
        "target": _IGNORED, "link": Node(attrs={"state": r"up|down"}), **_DEV}),
    "memballoon": Node(attrs={"model": "virtio", "autodeflate": _ONOFF, "freePageReporting": _ONOFF},
                       children={"stats": Node(attrs={"period": _NUM}), **_DEV}),
}

_STATE = Node(attrs={"state": _ONOFF})
DOMAIN = Node(attrs={"type": r"qemu|kvm", "id": None}, children={
    "name": Node(text=None), "uuid": Node(text=None),
    "memory": Node(attrs={"unit": "KiB"}, text=_NUM), "currentMemory": Node(attrs={"unit": "KiB"}, text=_NUM),
    "vcpu": Node(attrs={"placement": r"static|auto", "current": _NUM}, text=_NUM),
    "resource": Node(children={"partition": Node(text=None)}),
    "os": Node(children={"type": Node(attrs={"arch": "x86_64", "machine": r"pc|pc-i440fx-[0-9.]{1,16}"}, text="hvm"),
                         "kernel": Node(text=None), "initrd": Node(text=None), "cmdline": Node(text=None),
                         "boot": Node(attrs={"dev": "hd"})}),
    "features": Node(children={"acpi": Node(), "apic": Node(attrs={"eoi": _ONOFF}), "pae": Node(), "pmu": _STATE,
                               "vmport": _STATE, "smm": _STATE}),
    "cpu": Node(attrs={"mode": r"custom|host-model|host-passthrough|maximum", "match": r"exact|minimum|strict",
                       "check": r"none|partial|full", "migratable": _ONOFF}, children={
        "model": Node(attrs={"fallback": r"allow|forbid", "vendor_id": _ID}, text=_ID),
        "vendor": Node(text=_ID),
        "feature": Node(attrs={"policy": r"force|require|optional|disable|forbid", "name": _ID}),
        "topology": Node(attrs={k: _NUM for k in ("sockets", "dies", "clusters", "cores", "threads")})}),
    "clock": Node(attrs={"offset": "utc"}, children={
        "timer": Node(attrs={"name": _ID, "present": r"yes|no", "tickpolicy": _ID, "track": _ID})}),
    "on_poweroff": Node(text=None), "on_reboot": Node(text=None), "on_crash": Node(text=None),
    "seclabel": Node(attrs={"type": r"dynamic|static|none", "model": r"dac|selinux|apparmor", "relabel": r"yes|no"},
                     children={"label": Node(text=None), "imagelabel": Node(text=None)}),
    "devices": Node(children=DEVICES),
    # a live move's destination adds a QMP monitor of its own (qmp.with_monitor): never used here
    "qemu:commandline": Node(children={"qemu:arg": Node(attrs={
        "value": r"-qmp|unix:/[A-Za-z0-9_./+-]{1,255}/" + re.escape(MONITOR) + r",server=on,wait=off"})}),
})


def _tag(el: ET.Element) -> str:
    if el.tag.startswith("{"):
        ns, _, local = el.tag[1:].partition("}")
        return f"{'qemu' if 'libvirt.org/schemas/domain/qemu' in ns else ns}:{local}"
    return el.tag


def _refuse(what: str) -> IntegrityError:
    return IntegrityError(f"the memory image's domain XML carries {what}: this host restores a memory image "
                          "only as the machine of its own template, so it refuses this one")


def _check(el: ET.Element, node: Node, path: str) -> None:
    for attr, value in el.attrib.items():
        if attr in node.attrs:
            pattern = node.attrs[attr]
        elif "*" in node.attrs:
            pattern = node.attrs["*"]
        else:
            raise _refuse(f"<{path}> with the attribute {_tag(ET.Element(attr))}={value[:80]!r}")
        if pattern is not None and not re.fullmatch(pattern, value):
            raise _refuse(f"<{path} {attr}={value[:80]!r}>")
    if node.text is not None and not re.fullmatch(node.text, (el.text or "").strip()):
        raise _refuse(f"<{path}> with the value {(el.text or '').strip()[:80]!r}")
    if node.opaque:
        return
    for child in el:
        tag = _tag(child)
        sub = node.children.get(tag) or node.children.get("*")
        if sub is None:
            raise _refuse(f"<{path}/{tag}>")
        _check(child, sub, f"{path}/{tag}")


def check(saved_xml: str, template_devices: set[str] | None = None) -> ET.Element:
    """Parse the image's XML and check it against the allow-list (plus, as opaque devices, any device kind the
    template has and the allow-list does not model). Raises :class:`IntegrityError`; returns the tree."""
    try:
        root = ET.fromstring(saved_xml)
    except ET.ParseError as exc:
        raise IntegrityError(f"the memory image's domain XML is malformed ({exc})") from exc
    if root.tag != "domain":
        raise IntegrityError(f"the memory image's domain XML has <{_tag(root)}> where <domain> belongs")
    devices = dict(DEVICES)
    for tag in template_devices or ():
        devices.setdefault(tag, Node(attrs={"*": None}, opaque=True))
    _check(root, replace(DOMAIN, children={**DOMAIN.children, "devices": Node(children=devices)}), "domain")
    return root


def _kib(root: ET.Element, tag: str) -> int:
    return int((root.findtext(tag) or "0").strip())


def _graft_address(src: ET.Element, dst: ET.Element) -> None:
    for old in dst.findall("address"):
        dst.remove(old)
    for addr in src.findall("address"):
        dst.append(copy.deepcopy(addr))


def _replace_child(parent: ET.Element, new: ET.Element | None, index_after: str | None = None) -> None:
    if new is None:
        return
    old = parent.find(new.tag)
    if old is not None:
        parent[list(parent).index(old)] = copy.deepcopy(new)
        return
    pos = len(parent)
    if index_after is not None and (after := parent.find(index_after)) is not None:
        pos = list(parent).index(after) + 1
    parent.insert(pos, copy.deepcopy(new))


def _device_key(el: ET.Element) -> tuple[str, ...]:
    if el.tag == "controller":
        return ("controller", el.get("type", ""), el.get("index", "0"))
    if el.tag == "input":
        return ("input", el.get("type", ""), el.get("bus", ""))
    return (el.tag,)


def rebuild(saved_xml: str, spec: MachineSpec) -> tuple[str, str]:
    """The XML to restore a memory image with, and the accelerator it needs ("kvm" or "tcg"). ``spec`` is this
    host's machine: this store's kernel and initrd, this instance's leaves, console log and agent socket, the
    version's config, this host's emulator. Raises :class:`IntegrityError` before anything starts."""
    accel = saved_accel(saved_xml)
    dom = ET.fromstring(build(replace(spec, accel=accel)))
    devices = dom.find("devices")
    assert devices is not None
    saved = check(saved_xml, {el.tag for el in devices})

    memory, current = _kib(saved, "memory"), _kib(saved, "currentMemory") or _kib(saved, "memory")
    if memory != spec.memory_mib * 1024:
        raise IntegrityError(f"the memory image holds {memory // 1024} MiB of RAM, the version's config says "
                             f"{spec.memory_mib} MiB")
    if not 0 < current <= memory:
        raise IntegrityError(f"the memory image's current memory ({current} KiB) is not within its RAM")
    vcpus = int((saved.findtext("vcpu") or "0").strip())
    if vcpus != spec.vcpus:
        raise IntegrityError(f"the memory image has {vcpus} vCPU(s), the version's config says {spec.vcpus}")
    for tag, kib in (("memory", memory), ("currentMemory", current)):
        el = dom.find(tag)
        assert el is not None
        el.attrib = {"unit": "KiB"}
        el.text = str(kib)
    os_type, saved_type = dom.find("os/type"), saved.find("os/type")
    if os_type is not None and saved_type is not None:
        os_type.attrib.update({k: v for k, v in saved_type.attrib.items() if k in ("arch", "machine")})
    _replace_child(dom, saved.find("features"), "os")
    _replace_child(dom, saved.find("cpu"), "features")
    _replace_child(dom, saved.find("clock"), "cpu")

    saved_devices = saved.find("devices")
    saved_list = list(saved_devices) if saved_devices is not None else []
    if not any(el.tag == "video" for el in saved_list):
        # saved before capsules had a screen: a VGA card would change the machine the state was saved from
        for el in devices.findall("graphics") + devices.findall("video"):
            devices.remove(el)
    if not any(el.tag == "input" and el.get("type") == "tablet" for el in saved_list):
        # saved (or running, for a live move) before capsules had a tablet: it joins at the next cold start
        for el in devices.findall("input"):
            if el.get("type") == "tablet":
                devices.remove(el)
    emulators = [el for el in saved_list if el.tag == "emulator"]
    for el in emulators:
        mine = (devices.findtext("emulator") or "").strip()
        if (el.text or "").strip() != mine:
            raise _refuse(f"another emulator ({(el.text or '').strip()[:120]}; this host runs "
                          f"{mine or 'libvirt default'})")
    _graft_devices(devices, [el for el in saved_list if el.tag != "emulator"], spec)
    return ET.tostring(dom, encoding="unicode"), accel


def _graft_devices(devices: ET.Element, saved: list[ET.Element], spec: MachineSpec) -> None:
    """Pair each saved device with the template's device of the same kind, in order, and take its address (and the
    few ABI attributes libvirt checks); the implicit controllers and PS/2 inputs libvirt adds are copied."""
    mine: dict[tuple[str, ...], list[ET.Element]] = {}
    for el in devices:
        if el.tag != "emulator":
            mine.setdefault(_device_key(el), []).append(el)
    theirs: dict[tuple[str, ...], list[ET.Element]] = {}
    for el in saved:
        theirs.setdefault(_device_key(el), []).append(el)
    disks = theirs.get(("disk",), [])
    if len(disks) != len(spec.disks):
        raise _refuse(f"{len(disks)} disk(s) where the version has {len(spec.disks)}")
    for key, els in theirs.items():
        targets = mine.get(key, [])
        implicit = key[0] == "input" or (key[0] == "controller" and key[1] in ("pci", "usb", "ide"))
        if not targets and implicit:
            for el in els:
                devices.append(_implicit_copy(el))
            continue
        if len(els) != len(targets):
            what = " ".join(key)
            raise _refuse(f"{len(els)} <{what}> device(s) where this host's template has {len(targets)}")
        for src, dst in zip(els, targets, strict=True):
            _graft_one(src, dst)
    for key in mine:
        if key not in theirs:
            raise IntegrityError(f"the memory image's domain XML has no <{' '.join(key)}> device; this host's "
                                 "template has one, so the saved device state cannot match it")


def _graft_one(src: ET.Element, dst: ET.Element) -> None:
    if src.tag == "disk":
        theirs, mine = src.find("target"), dst.find("target")
        if theirs is not None and mine is not None and theirs.get("dev") != mine.get("dev"):
            raise _refuse(f"the disk {theirs.get('dev')} in the place of {mine.get('dev')}")
    elif src.tag == "serial":
        _replace_child(dst, src.find("target"))
    elif src.tag == "controller":
        for attr in ("model", "ports", "vectors"):
            if attr in src.attrib:
                dst.set(attr, src.attrib[attr])
    elif src.tag == "video":
        theirs, mine = src.find("model"), dst.find("model")
        if theirs is not None and mine is not None:
            for attr in ("vram", "heads"):
                if attr in theirs.attrib:
                    mine.set(attr, theirs.attrib[attr])
    elif src.tag == "interface":
        # the guest's NIC holds the MAC it was saved with (a fork of another capsule's image keeps it)
        theirs, mine = src.find("mac"), dst.find("mac")
        if theirs is not None and mine is not None:
            mine.set("address", theirs.get("address", ""))
    elif src.tag == "memballoon":
        for attr in ("autodeflate", "freePageReporting"):
            if attr in src.attrib:
                dst.set(attr, src.attrib[attr])
    _graft_address(src, dst)


def _implicit_copy(el: ET.Element) -> ET.Element:
    new = ET.Element(el.tag, dict(el.attrib))
    for addr in el.findall("address"):
        new.append(copy.deepcopy(addr))
    return new


def saved_accel(saved_xml: str) -> str:
    """The accelerator a memory image was saved under ("kvm" or "tcg"): it must be restored under the same one."""
    try:
        return "kvm" if ET.fromstring(saved_xml).get("type") == "kvm" else "tcg"
    except ET.ParseError as exc:
        raise IntegrityError(f"the memory image's domain XML is malformed ({exc})") from exc


def host_emulator(accel: str, arch: str = "x86_64") -> str | None:
    """The emulator libvirt on this host runs for ``arch`` guests (None when its capabilities do not say)."""
    from capsule.runtime.connection import connect

    caps = ET.fromstring(connect().getCapabilities())
    for guest in caps.findall("guest"):
        arch_el = guest.find("arch")
        if guest.findtext("os_type") != "hvm" or arch_el is None or arch_el.get("name") != arch:
            continue
        for dom in arch_el.findall("domain"):
            if dom.get("type") == ("kvm" if accel == "kvm" else "qemu") and dom.findtext("emulator"):
                return (dom.findtext("emulator") or "").strip()
        return (arch_el.findtext("emulator") or "").strip() or None
    return None
