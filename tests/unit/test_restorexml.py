"""The XML a memory image is restored with is rebuilt from this host's template: nothing of the saving host's
paths survives, and anything outside the allow-list is refused by name."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from capsule.errors import IntegrityError
from capsule.runtime.domainxml import MachineSpec, build
from capsule.runtime.restorexml import rebuild

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SOURCE = "/srv/host-a/store"
KERNEL, INITRD = "e4baaf4557a327d0a8f2b4a300b80ac4e1d1a0e50c39250175e98654e0460d92", "c425ad71" * 8

# what libvirt writes into a sparse save image of a capsule instance (TCG), with host A's paths
SAVED = f"""<domain type='qemu'>
  <name>capsule-aaaa-x</name>
  <uuid>3632186f-8e70-4d6e-9543-448274749757</uuid>
  <memory unit='KiB'>262144</memory>
  <currentMemory unit='KiB'>131072</currentMemory>
  <vcpu placement='static'>1</vcpu>
  <resource><partition>/machine</partition></resource>
  <os>
    <type arch='x86_64' machine='pc-i440fx-10.0'>hvm</type>
    <kernel>{SOURCE}/files/{KERNEL}</kernel>
    <initrd>{SOURCE}/files/{INITRD}</initrd>
    <cmdline>console=ttyS0,115200 quiet panic=-1</cmdline>
    <boot dev='hd'/>
  </os>
  <features><acpi/></features>
  <cpu mode='custom' match='exact' check='none'><model fallback='allow'>qemu64</model></cpu>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2' cache='writeback' error_policy='stop' rerror_policy='stop' discard='unmap'/>
      <source file='{SOURCE}/layers/leaf-998f78cd.qcow2'/>
      <backingStore type='file'><format type='qcow2'/><source file='{SOURCE}/layers/x.qcow2'/></backingStore>
      <target dev='vda' bus='virtio'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x07' function='0x0'/>
    </disk>
    <controller type='virtio-serial' index='0'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x0'/>
    </controller>
    <controller type='usb' index='0' model='piix3-uhci'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x01' function='0x2'/>
    </controller>
    <controller type='pci' index='0' model='pci-root'/>
    <serial type='pty'>
      <log file='{SOURCE}/instances/x/console.log' append='on'/>
      <target type='isa-serial' port='0'><model name='isa-serial'/></target>
    </serial>
    <console type='pty'>
      <log file='{SOURCE}/instances/x/console.log' append='on'/>
      <target type='serial' port='0'/>
    </console>
    <channel type='unix'>
      <source mode='bind' path='{SOURCE}/instances/x/agent.sock'/>
      <target type='virtio' name='org.capsule.agent.0'/>
      <address type='virtio-serial' controller='0' bus='0' port='1'/>
    </channel>
    <input type='mouse' bus='ps2'/>
    <memballoon model='virtio' freePageReporting='on'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x04' function='0x0'/>
    </memballoon>
  </devices>
</domain>
"""

HERE = Path("/var/lib/host-b/store")


def spec(disks: int = 1, **kw) -> MachineSpec:
    fields = dict(name="capsule-bbbb-x", uuid="0b6f3e53-2a52-4a1e-8a0e-9e1d3c7f0001", memory_mib=256, vcpus=1,
                  accel="tcg", kernel=HERE / "files" / KERNEL, initrd=HERE / "files" / INITRD,
                  cmdline="console=ttyS0,115200 quiet panic=-1",
                  disks=[HERE / "layers" / f"leaf-{i}.qcow2" for i in range(disks)],
                  console_log=HERE / "instances/x/console.log", agent_socket=HERE / "instances/x/agent.sock",
                  emulator="/usr/bin/qemu-system-x86_64")
    fields.update(kw)
    return MachineSpec(**fields)


def with_devices(extra: str) -> str:
    return SAVED.replace("  </devices>", extra + "\n  </devices>")


def test_clean_image_is_rebuilt_with_this_hosts_paths_only():
    xml, accel = rebuild(SAVED, spec())
    assert accel == "tcg"
    assert SOURCE not in xml and "host-a" not in xml
    dom = ET.fromstring(xml)
    assert dom.findtext("name") == "capsule-bbbb-x"
    assert dom.findtext("os/kernel") == str(HERE / "files" / KERNEL)
    assert dom.findtext("os/initrd") == str(HERE / "files" / INITRD)
    assert dom.find("devices/disk/source").get("file") == str(HERE / "layers/leaf-0.qcow2")
    assert dom.find("devices/serial/log").get("file") == str(HERE / "instances/x/console.log")
    assert dom.find("devices/channel/source").get("path") == str(HERE / "instances/x/agent.sock")
    assert dom.findtext("devices/emulator") == "/usr/bin/qemu-system-x86_64"
    # what the saved device state requires comes from the image
    assert dom.find("os/type").get("machine") == "pc-i440fx-10.0"
    assert dom.find("devices/disk/address").get("slot") == "0x07"
    assert dom.find("devices/memballoon/address").get("slot") == "0x04"
    assert dom.find("devices/channel/address").get("port") == "1"
    assert dom.find("devices/serial/target").get("type") == "isa-serial"
    assert dom.findtext("currentMemory") == "131072" and dom.findtext("memory") == "262144"
    assert dom.findtext("cpu/model") == "qemu64"
    usb = [c for c in dom.findall("devices/controller") if c.get("type") == "usb"]
    assert len(usb) == 1 and usb[0].find("address").get("function") == "0x2"
    assert dom.find("devices/disk/backingStore") is None


def test_kvm_image_keeps_its_accelerator_and_cpu_model():
    saved = SAVED.replace("<domain type='qemu'>", "<domain type='kvm'>").replace(
        "<model fallback='allow'>qemu64</model>",
        "<model fallback='forbid'>Skylake-Client-IBRS</model><vendor>Intel</vendor>"
        "<feature policy='require' name='ss'/>")
    xml, accel = rebuild(saved, spec())
    dom = ET.fromstring(xml)
    assert accel == "kvm" and dom.get("type") == "kvm"
    assert dom.findtext("cpu/model") == "Skylake-Client-IBRS" and dom.find("cpu/feature").get("name") == "ss"


@pytest.mark.parametrize(("saved", "named"), [
    (with_devices("<hostdev mode='subsystem' type='pci'><source><address domain='0' bus='1' slot='0' "
                  "function='0'/></source></hostdev>"), "hostdev"),
    (with_devices("<filesystem type='mount'><source dir='/'/><target dir='root'/></filesystem>"), "filesystem"),
    (SAVED.replace("/usr/bin/qemu-system-x86_64", "/tmp/evil/qemu"), "emulator"),
    (with_devices(f"<disk type='file' device='disk'><source file='{SOURCE}/x'/><target dev='vdb' bus='virtio'/>"
                  "</disk>"), "disk"),
    (with_devices("<disk type='file' device='cdrom'><source file='/etc/shadow'/><target dev='hdc' bus='ide'/>"
                  "</disk>"), "disk"),
    (with_devices("<interface type='network'><source network='default'/></interface>"), "interface"),
    (with_devices("<channel type='unix'><source mode='bind' path='/tmp/x'/>"
                  "<target type='virtio' name='org.qemu.guest_agent.0'/></channel>"), "channel"),
    (with_devices("<serial type='file'><source path='/etc/passwd'/><target port='1'/></serial>"), "serial"),
    (SAVED.replace("</domain>", "<qemu:commandline xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>"
                   "<qemu:arg value='-fw_cfg'/></qemu:commandline></domain>"), "qemu:commandline"),
    (SAVED.replace("<boot dev='hd'/>", "<loader>/srv/host-a/OVMF.fd</loader>"), "loader"),
    (SAVED.replace("<disk type='file' device='disk'>", "<disk type='block' device='disk'>"), "disk"),
    (SAVED.replace("<domain type='qemu'>", "<domain type='xen'>"), "domain"),
    (SAVED.replace("machine='pc-i440fx-10.0'", "machine='pc-q35-10.0'"), "machine"),
])
def test_anything_outside_the_allow_list_is_refused_by_name(saved, named):
    with pytest.raises(IntegrityError, match=re.escape(named)):
        rebuild(saved, spec())


def test_disk_count_must_match_the_version():
    with pytest.raises(IntegrityError, match="1 disk"):
        rebuild(SAVED, spec(disks=2))


def test_memory_and_vcpus_must_match_the_config():
    with pytest.raises(IntegrityError, match="RAM"):
        rebuild(SAVED, spec(memory_mib=512))
    with pytest.raises(IntegrityError, match="vCPU"):
        rebuild(SAVED, spec(vcpus=2))


def test_missing_template_device_is_refused():
    saved = re.sub(r"<memballoon.*?</memballoon>", "", SAVED, flags=re.S)
    with pytest.raises(IntegrityError, match="memballoon"):
        rebuild(saved, spec())


def test_malformed_xml_is_an_integrity_error():
    with pytest.raises(IntegrityError, match="malformed"):
        rebuild(SAVED[:200], spec())


SCREEN = f"""<graphics type='vnc' socket='{SOURCE}/instances/x/vnc.sock'>
      <listen type='socket' socket='{SOURCE}/instances/x/vnc.sock'/>
    </graphics>
    <video>
      <model type='vga' vram='8192' heads='1' primary='yes'/>
      <alias name='video0'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x05' function='0x0'/>
    </video>"""


def test_screen_is_rebuilt_with_this_hosts_socket_and_the_images_vga_card():
    here = HERE / "instances/x/vnc.sock"
    xml, _ = rebuild(with_devices(SCREEN), spec(vnc_socket=here))
    assert SOURCE not in xml
    dom = ET.fromstring(xml)
    (graphics,) = dom.findall("devices/graphics")
    assert graphics.get("type") == "vnc" and graphics.get("port") is None
    assert graphics.find("listen").attrib == {"type": "socket", "socket": str(here)}
    (video,) = dom.findall("devices/video")
    assert video.find("model").get("vram") == "8192"            # the card's memory is device state: the image's
    assert video.find("address").get("slot") == "0x05"


def test_image_saved_without_a_screen_gets_none():
    xml, _ = rebuild(SAVED, spec(vnc_socket=HERE / "instances/x/vnc.sock"))
    dom = ET.fromstring(xml)
    assert dom.find("devices/graphics") is None and dom.find("devices/video") is None


@pytest.mark.parametrize(("extra", "named"), [
    (SCREEN.replace("type='vnc'", "type='spice'"), "spice"),
    (SCREEN.replace("type='vga'", "type='qxl'"), "qxl"),
    (SCREEN.replace("<alias name='video0'/>", "<driver name='vhostuser'/>"), "driver"),
])
def test_other_screens_are_refused(extra, named):
    with pytest.raises(IntegrityError, match=named):
        rebuild(with_devices(extra), spec(vnc_socket=HERE / "instances/x/vnc.sock"))


def test_a_leaf_on_a_disk_server_names_its_nbd_backing_with_a_reconnect_delay():
    """Demand paging: QEMU may reconnect to a disk server the watcher started again, boot or restore alike;
    a disk without a server keeps the backing its leaf's header names."""
    sock = HERE / "instances/x/disk1.nbd"
    xml, _ = rebuild(SAVED.replace("</disk>", "</disk>" + SAVED.split("<devices>")[1].split("</disk>")[0]
                                   .replace("slot='0x07'", "slot='0x08'").replace("vda", "vdb") + "</disk>", 1),
                     spec(disks=2, disk_servers={1: sock}))
    first, second = ET.fromstring(xml).findall("devices/disk")
    assert first.find("backingStore") is None
    bs = second.find("backingStore")
    assert bs.get("type") == "network" and bs.find("format").get("type") == "raw"
    assert bs.find("source").get("protocol") == "nbd"
    assert bs.find("source/host").attrib == {"transport": "unix", "socket": str(sock)}
    assert int(bs.find("source/reconnect").get("delay")) > 0
    assert bs.find("backingStore") is not None and len(bs.find("backingStore")) == 0  # the chain ends there


# the screen's absolute pointer (``domainxml.add_pointer``): every capsule with a screen boots with a virtio tablet;
# an image (or a running guest, for a live move) with one keeps it at its address; one saved before has none until
# its next boot
TABLET = """<input type='tablet' bus='virtio'>
      <alias name='input0'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x06' function='0x0'/>
    </input>"""
VNC = HERE / "instances/x/vnc.sock"


def tablets(xml: str) -> list[ET.Element]:
    return [el for el in ET.fromstring(xml).findall("devices/input") if el.get("type") == "tablet"]


def test_a_capsule_with_a_screen_boots_with_a_virtio_tablet_and_one_without_has_none():
    (tablet,) = tablets(build(spec(vnc_socket=VNC)))
    assert tablet.attrib == {"type": "tablet", "bus": "virtio"}
    assert tablets(build(spec())) == []


def test_an_image_with_a_tablet_keeps_it_at_its_saved_address():
    xml, _ = rebuild(with_devices(SCREEN + "\n    " + TABLET), spec(vnc_socket=VNC))
    (tablet,) = tablets(xml)
    assert tablet.get("bus") == "virtio" and tablet.find("address").get("slot") == "0x06"


def test_an_image_saved_before_tablets_is_restored_without_one_and_boots_with_one():
    assert len(tablets(build(spec(vnc_socket=VNC)))) == 1     # the next cold start has it
    xml, _ = rebuild(with_devices(SCREEN), spec(vnc_socket=VNC))
    assert tablets(xml) == []
    assert ET.fromstring(xml).find("devices/video") is not None


def test_a_usb_tablet_is_not_this_hosts_machine():
    with pytest.raises(IntegrityError, match="usb"):
        rebuild(with_devices(SCREEN + "\n    " + TABLET.replace("'virtio'", "'usb'")), spec(vnc_socket=VNC))
