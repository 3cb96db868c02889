"""Pure parts shared by the guest and the host: pod names, addresses, their allocation."""

from __future__ import annotations

import hashlib
import ipaddress
import re

NAME_RX = re.compile(r"[a-z][a-z0-9-]{0,30}")
# the benchmarking range (RFC 2544), never routed outside the guest: one /24 for the pods of a capsule
DEFAULT_SUBNET = ipaddress.IPv4Network("198.18.0.0/24")
BRIDGE = "pods0"
# the capsule's NIC on the host's pod bridge (``capsule create --pod-network``) has a MAC with this prefix
# (locally administered, unicast): pods0 takes it as its uplink, so the pods of all such capsules of a
# host share one L2 segment
UPLINK_MAC_PREFIX = "0e:70:6f:"


class PodError(Exception):
    """A pod operation failed; ``kind`` names the class the host raises again."""

    kind = "pod_error"

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        if kind:
            self.kind = kind


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RX.fullmatch(name):
        raise PodError(f"pod name {name!r}: use 1-31 characters a-z, 0-9 and '-', starting with a letter",
                       "invalid_name")
    return name


def parse_ip(text: str) -> ipaddress.IPv4Interface:
    """``A.B.C.D/N`` (``/N`` defaults to 24); a host address of its network, not the gateway."""
    if "/" not in text:
        text += "/24"
    try:
        iface = ipaddress.IPv4Interface(text)
    except ValueError as exc:
        raise PodError(f"pod address {text!r}: {exc}; use A.B.C.D/N", "invalid_name") from None
    net = iface.network
    if net.prefixlen > 30:
        raise PodError(f"pod address {text}: the network /{net.prefixlen} is too small (at most /30)",
                       "invalid_name")
    if iface.ip in (net.network_address, net.broadcast_address):
        raise PodError(f"pod address {text}: not a host address of {net}", "invalid_name")
    if iface.ip == gateway(net):
        raise PodError(f"pod address {text}: {iface.ip} is the bridge's own address in the capsule",
                       "ip_clash")
    return iface


def gateway(net: ipaddress.IPv4Network) -> ipaddress.IPv4Address:
    """The bridge's address in a pod network: its first host address."""
    return net.network_address + 1


def allocate(used: set[ipaddress.IPv4Address], net: ipaddress.IPv4Network = DEFAULT_SUBNET
             ) -> ipaddress.IPv4Interface:
    """The lowest free host address of ``net`` after the gateway."""
    for host in net.hosts():
        if host != gateway(net) and host not in used:
            return ipaddress.IPv4Interface(f"{host}/{net.prefixlen}")
    raise PodError(f"no free pod address left in {net}", "ip_clash")


def check_free(iface: ipaddress.IPv4Interface, taken: dict[str, ipaddress.IPv4Interface]) -> None:
    """Refuse an address another pod holds, or a network overlapping another pod's differently."""
    for other, addr in taken.items():
        if addr.ip == iface.ip:
            raise PodError(f"address {iface.ip} is taken by pod {other!r} in this capsule", "ip_clash")
        if addr.network != iface.network and addr.network.overlaps(iface.network):
            raise PodError(f"network {iface.network} overlaps {addr.network} of pod {other!r}", "ip_clash")


def host_veth(name: str) -> str:
    """The capsule-side end of a pod's veth pair (interface names are at most 15 bytes)."""
    return "pv" + hashlib.sha256(name.encode()).hexdigest()[:10]
