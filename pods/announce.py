"""``python3 -m pods.announce IFACE ADDRESS`` (run inside a pod's network namespace): gratuitous ARP for
the pod's address from its own MAC, so that after a restore in another capsule the bridges on the way
(the capsule's pods0, the host's pod bridge) learn the pod's new port at once and its peers' ARP caches
are refreshed, instead of sending to the capsule it left until their entries age out."""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
import time

ETH_P_ARP = 0x0806
SIOCGIFHWADDR = 0x8927
BROADCAST = b"\xff" * 6


def frame(mac: bytes, ip: bytes) -> bytes:
    """An ARP request for ``ip`` from ``ip`` itself (sender = target: gratuitous), broadcast, padded to 60 bytes."""
    arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, mac, ip, b"\0" * 6, ip)
    raw = BROADCAST + mac + struct.pack("!H", ETH_P_ARP) + arp
    return raw + b"\0" * (60 - len(raw))


def hw_address(s: socket.socket, iface: str) -> bytes:
    """The interface's MAC, asked of this network namespace (sysfs may be another namespace's)."""
    return fcntl.ioctl(s.fileno(), SIOCGIFHWADDR, struct.pack("256s", iface.encode()[:15]))[18:24]


COUNT, INTERVAL = 3, 0.05


def announce(iface: str, address: str, count: int = COUNT, interval: float = INTERVAL) -> str:
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((iface, ETH_P_ARP))
        mac = hw_address(s, iface)
        data = frame(mac, socket.inet_aton(address.split("/")[0]))
        for i in range(count):
            if i:
                time.sleep(interval)
            s.send(data)
    return mac.hex(":")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python3 -m pods.announce IFACE ADDRESS")
    print(announce(sys.argv[1], sys.argv[2]))
