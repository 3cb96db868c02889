"""The host's pod bridge: one L2 bridge (``capsulepods0``) that every capsule made with ``--pod-network``
joins through a virtio NIC. Inside the guest the pod layer's bridge pods0 enslaves that NIC, so the pods
of all those capsules of a host share one segment of 198.18.0.0/24 (RFC 2544's benchmarking range) and a
pod keeps its address when it moves to another capsule. The bridge has no address on the host: the
host takes no part in the pods' traffic, and nothing routes it anywhere else."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from capsule.errors import EnvironmentProblem
from pods.names import UPLINK_MAC_PREFIX

BRIDGE = "capsulepods0"
CONFIG_KEY = "pod_network"   # a version's config: the capsule has a NIC on the pod bridge


def uplink_mac(capsule_uuid: str) -> str:
    """The capsule's NIC on the pod bridge: UPLINK_MAC_PREFIX (which the guest recognises) and three bytes
    of the capsule's uuid: stable for the capsule on every host, distinct between capsules (but a 1 in
    2**24 chance of a clash, which the pods would not notice: the NIC is a bridge port in the guest, its
    own MAC is the source of no frame)."""
    tail = hashlib.sha256(capsule_uuid.encode()).hexdigest()[:6]
    return UPLINK_MAC_PREFIX + ":".join(tail[i:i + 2] for i in range(0, 6, 2))


def _ip(*argv: str) -> None:
    r = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if r.returncode != 0:
        raise EnvironmentProblem(f"the pod bridge {BRIDGE}: `ip {' '.join(argv)}` failed: "
                                 f"{r.stderr.strip()} (it needs root, or CAP_NET_ADMIN)")


def ensure_bridge() -> str:
    """Create the host's pod bridge when it is missing (no address, no IPv6, no STP), bring it up."""
    sys = Path("/sys/class/net") / BRIDGE
    if not sys.exists():
        _ip("link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
    v6 = Path("/proc/sys/net/ipv6/conf") / BRIDGE / "disable_ipv6"
    if v6.exists() and v6.read_text().strip() != "1":
        v6.write_text("1")
    _ip("link", "set", BRIDGE, "up")
    return BRIDGE
