"""Two hosts joined by a shaped link: network namespaces A and B, a veth pair
between them rate-limited with ``tbf`` on both ends, and latency added by a
user-space delaying proxy (testkit/delayproxy.py) in A in front of B's port.

    with SlowLink(rate_kbit=384, rtt_ms=20) as link:
        link.exec_a([...])                     # run a command inside A
        link.spawn_b([...])                    # start a daemon inside B
        url = link.url_b(7070)                 # reach B's port from A, through the delay

Set-up and tear-down are automatic and leave nothing behind (namespaces,
veths, qdiscs, processes). Presets: DSL = 384 kbit/s, 20 ms RTT (the paper's);
LAN = 100 Mbit/s, 1 ms RTT.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TypedDict

from testkit.processes import stop_groups

HERE = Path(__file__).resolve().parent


class Shape(TypedDict):
    """A link's shape: ``SlowLink(**DSL)``."""

    rate_kbit: int
    rtt_ms: float


DSL: Shape = {"rate_kbit": 384, "rtt_ms": 20.0}
LAN: Shape = {"rate_kbit": 100_000, "rtt_ms": 1.0}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class SlowLink:
    def __init__(self, rate_kbit: int = 384, rtt_ms: float = 20.0) -> None:
        tag = secrets.token_hex(3)
        self.ns_a, self.ns_b = f"capsule-a-{tag}", f"capsule-b-{tag}"
        self.veth_a, self.veth_b = f"cva{tag}", f"cvb{tag}"
        n = int(tag, 16) % 250 + 1
        # RFC 2544's benchmarking range, inside namespaces of our own: never a private-range address
        self.ip_a, self.ip_b = f"198.18.{n}.1", f"198.18.{n}.2"
        self.rate_kbit = rate_kbit
        self.rtt_ms = rtt_ms
        self.procs: list[subprocess.Popen[bytes]] = []
        self._proxies: dict[int, int] = {}

    # -- set-up / tear-down ---------------------------------------------------------
    def __enter__(self) -> SlowLink:
        try:
            _ip("netns", "add", self.ns_a)
            _ip("netns", "add", self.ns_b)
            _ip("link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
            _ip("link", "set", self.veth_a, "netns", self.ns_a)
            _ip("link", "set", self.veth_b, "netns", self.ns_b)
            for ns, dev, addr in ((self.ns_a, self.veth_a, self.ip_a), (self.ns_b, self.veth_b, self.ip_b)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                # tbf: rate; burst at least one MTU-sized packet; queue bounded by latency
                burst = max(3200, self.rate_kbit * 1000 // 8 // 100)
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                "rate", f"{self.rate_kbit}kbit", "burst", str(burst), "latency", "400ms"],
                               check=True, capture_output=True)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        stop_groups(self.procs)
        for ns in (self.ns_a, self.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    # -- running things ---------------------------------------------------------------
    def _wrap(self, ns: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]

    def exec_a(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
        return subprocess.run(self._wrap(self.ns_a, cmd), **kw)

    def spawn(self, ns: str, cmd: list[str], **kw) -> subprocess.Popen[bytes]:  # noqa: ANN003
        p = subprocess.Popen(self._wrap(ns, cmd), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def spawn_a(self, cmd: list[str], **kw) -> subprocess.Popen[bytes]:  # noqa: ANN003
        return self.spawn(self.ns_a, cmd, **kw)

    def spawn_b(self, cmd: list[str], **kw) -> subprocess.Popen[bytes]:  # noqa: ANN003
        return self.spawn(self.ns_b, cmd, **kw)

    def proxy_b(self, port: int) -> int:
        """A port on 127.0.0.1 inside A that reaches B's ``port`` through the delaying proxy."""
        if port not in self._proxies:
            local = 20000 + len(self._proxies)
            self.spawn_a([sys.executable, str(HERE / "delayproxy.py"), "--listen", f"127.0.0.1:{local}",
                          "--to", f"{self.ip_b}:{port}", "--delay-ms", str(self.rtt_ms / 2)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._proxies[port] = local
            self._wait_port_a(local)
        return self._proxies[port]

    def agent_b(self, home: Path, token_file: Path, port: int = 7070, log: Path | None = None) -> tuple[str, str]:
        """Start ``capsule serve`` for the store at ``home`` inside B (its output to ``log``): off loopback
        it speaks TLS with its host key (made on its first start), so this returns the https URL that
        reaches it from A through the delay and its certificate's fingerprint, for the client to pin."""
        from capsule.agent.launch import serve_command
        from capsule.agent.serve import host_fingerprint

        out = log.open("ab") if log is not None else subprocess.DEVNULL
        self.spawn_b(serve_command(home, f"{self.ip_b}:{port}", token_file), stdout=out, stderr=subprocess.STDOUT,
                     cwd=HERE.parent)
        self.wait_port_b(port)
        pin = host_fingerprint(home)
        if pin is None:
            raise RuntimeError(f"the agent for {home} listens but made no host key")
        return f"https://127.0.0.1:{self.proxy_b(port)}", pin

    def url_b(self, port: int) -> str:
        """An http URL, valid inside A, for B's ``port`` through the delaying proxy."""
        return f"http://127.0.0.1:{self.proxy_b(port)}"

    def wire_bytes(self) -> int:
        """Bytes that have crossed the link so far, both directions, Ethernet/IP/TCP headers included."""
        out = subprocess.run(["ip", "-n", self.ns_a, "-j", "-s", "link", "show", "dev", self.veth_a],
                             check=True, capture_output=True, text=True).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])

    def _wait_port(self, host: str, port: int, timeout: float) -> None:
        """Wait until ``host:port`` accepts connections from inside A."""
        deadline = time.monotonic() + timeout
        probe = ("import socket,sys; s=socket.socket(); s.settimeout(0.5); "
                 f"sys.exit(s.connect_ex(('{host}', {port})))")
        while time.monotonic() < deadline:
            if self.exec_a([sys.executable, "-c", probe], capture_output=True).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{host}:{port} did not open (seen from {self.ns_a})")

    def _wait_port_a(self, port: int, timeout: float = 10.0) -> None:
        self._wait_port("127.0.0.1", port, timeout)

    def wait_port_b(self, port: int, timeout: float = 30.0) -> None:
        self._wait_port(self.ip_b, port, timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
