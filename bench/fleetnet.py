"""N hosts on one switch, each with its own shaped link: network namespace ``<tag>-<i>`` per host, a
bridge in a switch namespace of its own, and per host a veth pair rate-limited with ``tbf`` in both
directions (the host's uplink and its downlink). Nothing is set in the machine's own namespace.

    with Star(5, rate_kbit=20_000) as net:
        net.spawn(0, [...])          # a process inside host 0's namespace
        net.ip(3)                    # host 3's address (reachable from every host)

Set-up and tear-down leave nothing behind (namespaces, veths, processes)."""

from __future__ import annotations

import secrets
import subprocess

from testkit.processes import stop_groups


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _tbf(ns: str, dev: str, rate_kbit: int) -> None:
    burst = max(3200, rate_kbit * 1000 // 8 // 100)
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                    f"{rate_kbit}kbit", "burst", str(burst), "latency", "400ms"], check=True, capture_output=True)


class Star:
    def __init__(self, hosts: int, rate_kbit: int) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError("1..200 hosts")
        self.tag = secrets.token_hex(2)
        self.n = hosts
        self.rate_kbit = rate_kbit
        self.switch = f"cfs-{self.tag}"
        self.names = [f"cfh-{self.tag}-{i}" for i in range(hosts)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def ip(self, i: int) -> str:
        # RFC 2544's benchmarking range, inside this star's own namespaces: never a private-range address
        return f"198.19.{i // 250}.{i % 250 + 1}"

    def __enter__(self) -> Star:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                host_dev, sw_dev = f"cfa{self.tag}{i}", f"cfb{self.tag}{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", host_dev, "type", "veth", "peer", "name", sw_dev)
                _ip("link", "set", host_dev, "netns", ns)
                _ip("link", "set", sw_dev, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", sw_dev, "master", "br0")
                _ip("-n", self.switch, "link", "set", sw_dev, "up")
                _ip("-n", ns, "addr", "add", f"{self.ip(i)}/16", "dev", host_dev)
                _ip("-n", ns, "link", "set", host_dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _tbf(ns, host_dev, self.rate_kbit)               # the host's uplink
                _tbf(self.switch, sw_dev, self.rate_kbit)        # its downlink
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, i: int, cmd: list[str], **kw) -> subprocess.Popen[bytes]:  # noqa: ANN003
        p = subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def run(self, i: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
        return subprocess.run(["ip", "netns", "exec", self.names[i], *cmd], **kw)

    def close(self) -> None:
        stop_groups(self.procs, wait=10)
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
