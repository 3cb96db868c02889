"""The host's pod network in the machine's XML: the pod uplink NIC only when the config asks for it, its MAC
stable per capsule and recognisable by the guest; a memory image saved with one is restored with this host's
bridge and the MAC its guest holds; any other NIC is still refused. And the pod's gratuitous ARP frame."""

from __future__ import annotations

import re
import socket
import struct
import xml.etree.ElementTree as ET

import pytest

from capsule.errors import IntegrityError
from capsule.runtime import podnet
from capsule.runtime.domainxml import build
from capsule.runtime.restorexml import rebuild
from pods.announce import frame
from pods.names import UPLINK_MAC_PREFIX
from tests.unit.test_restorexml import spec, with_devices

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

UUID_A, UUID_B = "3632186f-8e70-4d6e-9543-448274749757", "0b6f3e53-2a52-4a1e-8a0e-9e1d3c7f0001"


def uplink(mac: str, bridge: str = podnet.BRIDGE, kind: str = "bridge") -> str:
    return (f"<interface type='{kind}'><mac address='{mac}'/><source bridge='{bridge}'/>"
            f"<target dev='vnet7'/><model type='virtio'/><alias name='net0'/>"
            f"<address type='pci' domain='0x0000' bus='0x00' slot='0x03' function='0x0'/></interface>")


def test_uplink_mac_is_stable_per_capsule_distinct_and_recognisable():
    a = podnet.uplink_mac(UUID_A)
    assert a == podnet.uplink_mac(UUID_A) and a != podnet.uplink_mac(UUID_B)
    assert a.startswith(UPLINK_MAC_PREFIX) and re.fullmatch(r"([0-9a-f]{2}:){5}[0-9a-f]{2}", a)
    first = int(a[:2], 16)
    assert first & 2 and not first & 1, "locally administered, unicast"


def test_the_nic_is_there_only_when_asked_for():
    assert ET.fromstring(build(spec())).find("devices/interface") is None
    mac = podnet.uplink_mac(UUID_B)
    nic = ET.fromstring(build(spec(pod_uplink=(podnet.BRIDGE, mac)))).find("devices/interface")
    assert nic is not None and nic.get("type") == "bridge"
    assert nic.find("source").get("bridge") == podnet.BRIDGE and nic.find("mac").get("address") == mac
    assert nic.find("model").get("type") == "virtio"


def test_an_image_with_the_uplink_is_restored_with_its_mac_and_address():
    saved_mac = podnet.uplink_mac(UUID_A)   # saved by capsule A, restored as B (a fork): the guest holds A's MAC
    xml, _ = rebuild(with_devices(uplink(saved_mac)), spec(pod_uplink=(podnet.BRIDGE, podnet.uplink_mac(UUID_B))))
    (nic,) = ET.fromstring(xml).findall("devices/interface")
    assert nic.find("mac").get("address") == saved_mac
    assert nic.find("source").get("bridge") == podnet.BRIDGE
    assert nic.find("address").get("slot") == "0x03"
    assert nic.find("target") is None, "the saving host's tap name is not kept"


@pytest.mark.parametrize(("nic", "named"), [
    (uplink(podnet.uplink_mac(UUID_A), bridge="br-lan"), "br-lan"),
    (uplink("52:54:00:12:34:56"), "52:54:00:12:34:56"),
    (uplink(podnet.uplink_mac(UUID_A), kind="direct"), "direct"),
])
def test_any_other_nic_is_refused(nic, named):
    with pytest.raises(IntegrityError, match=re.escape(named)):
        rebuild(with_devices(nic), spec(pod_uplink=(podnet.BRIDGE, podnet.uplink_mac(UUID_B))))


def test_an_uplink_the_template_lacks_is_refused():
    with pytest.raises(IntegrityError, match="interface"):
        rebuild(with_devices(uplink(podnet.uplink_mac(UUID_A))), spec())


def test_gratuitous_arp_frame():
    mac, ip = bytes.fromhex("0e706f0a0b0c"), socket.inet_aton("198.18.0.2")
    f = frame(mac, ip)
    assert len(f) == 60 and f[:6] == b"\xff" * 6 and f[6:12] == mac and f[12:14] == b"\x08\x06"
    htype, ptype, hlen, plen, op, sha, spa, tha, tpa = struct.unpack("!HHBBH6s4s6s4s", f[14:42])
    assert (htype, ptype, hlen, plen, op) == (1, 0x0800, 6, 4, 1)
    assert sha == mac and spa == tpa == ip and tha == b"\0" * 6
