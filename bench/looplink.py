"""A shaped link between hosts that share this machine's loopback (the compose
hosts: host networking): whatever should cross the link connects to a port of
a delaying proxy (testkit/delayproxy.py) in front of the real port, and ``htb``
on ``lo`` limits the traffic to and from those proxy ports only, at the same
rate each way (what ``tbf`` on both ends of testkit/netlink.py's veth does).
Every other packet on ``lo`` bypasses the shaping (htb's direct queue).

    with LoopLink(rate_kbit=8000, rtt_ms=20) as link:
        port = link.forward(20201, "127.0.0.1", 7372)   # 127.0.0.1:20201 reaches :7372 over the link
        before = link.wire_bytes()
        ...
        sent = link.wire_bytes() - before                # bytes that crossed, both ways, headers included

With ``mss`` (an Ethernet path's segment size, 1448) the proxies send segments of that size, and ``lo`` hands
the queue one segment a packet (its ``gso_max_segs`` 1 while the link exists): a real path carries packets of
an MTU, where loopback's segmentation offload builds packets of up to 64 KiB whatever the MSS. Those large
packets kept 30–41 kB standing in the link's queue at 384 kbit/s (0.6–0.9 s), where the same move with one
segment a packet kept about 3 kB.

Needs root and a loopback without a root qdisc of its own; everything is
removed on exit (the qdisc, the proxies, ``lo``'s own segmentation restored).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from testkit.processes import stop_groups

HERE = Path(__file__).resolve().parent
DEV = "lo"
TO_B, FROM_B = "1:10", "1:20"   # htb classes: towards the far end, back from it


class LinkBusy(RuntimeError):
    pass


def _run(*command: str) -> str:
    proc = subprocess.run(list(command), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def _tc(*args: str) -> str:
    return _run("tc", *args)


def _ip(*args: str) -> str:
    return _run("ip", *args)


class LoopLink:
    def __init__(self, rate_kbit: int, rtt_ms: float, mss: int = 0) -> None:
        self.rate_kbit = rate_kbit
        self.rtt_ms = rtt_ms
        self.mss = mss       # the segment size a sender may use across the link (0: loopback's own, 64 KiB)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        self._installed = False
        self._gso_segs: int | None = None    # lo's gso_max_segs before the link set it to 1 (with mss)

    def __enter__(self) -> LoopLink:
        root = json.loads(_tc("-j", "qdisc", "show", "dev", DEV) or "[]")
        if any(q.get("root") and q.get("kind") != "noqueue" for q in root):
            raise LinkBusy(f"{DEV} already has a root qdisc ({root}); another shaped run may be going on")
        # a queue of ~0.25 s at the rate (at least two 64 KiB loopback packets), burst one such packet
        limit = max(2 * 65536 + 4096, self.rate_kbit * 1000 // 8 // 4)
        try:
            _tc("qdisc", "add", "dev", DEV, "root", "handle", "1:", "htb")
            self._installed = True
            for cls, handle in ((TO_B, "10:"), (FROM_B, "20:")):
                _tc("class", "add", "dev", DEV, "parent", "1:", "classid", cls, "htb", "rate",
                    f"{self.rate_kbit}kbit", "ceil", f"{self.rate_kbit}kbit", "burst", "64k", "cburst", "64k")
                _tc("qdisc", "add", "dev", DEV, "parent", cls, "handle", handle, "bfifo", "limit", str(limit))
            if self.mss:
                self._gso_segs = _gso_max_segs()
                _ip("link", "set", "dev", DEV, "gso_max_segs", "1")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        stop_groups(self.procs)
        if self._installed:
            subprocess.run(["tc", "qdisc", "del", "dev", DEV, "root"], capture_output=True)
            self._installed = False
        if self._gso_segs is not None:
            subprocess.run(["ip", "link", "set", "dev", DEV, "gso_max_segs", str(self._gso_segs)],
                           capture_output=True)
            self._gso_segs = None

    def forward(self, port: int, to_host: str, to_port: int) -> int:
        """127.0.0.1:``port`` reaches ``to_host:to_port`` over the link (delayed, rate-limited both ways)."""
        # the address too: the proxy's own leg to a far end on the same port (another loopback address) is no
        # part of the link
        for addr, match, cls in (("dst", "dport", TO_B), ("src", "sport", FROM_B)):
            _tc("filter", "add", "dev", DEV, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", "protocol", "6", "0xff", "match", "ip", addr, "127.0.0.1/32",
                "match", "ip", match, str(port), "0xffff", "flowid", cls)
        self.procs.append(subprocess.Popen(
            [sys.executable, str(HERE.parent / "testkit" / "delayproxy.py"), "--listen", f"127.0.0.1:{port}",
             "--to", f"{to_host}:{to_port}", "--delay-ms", str(self.rtt_ms / 2), "--mss", str(self.mss)],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.ports.append(port)
        deadline = time.monotonic() + 10
        while True:   # listening (a probe connection would reach the far end: QEMU takes it for the stream)
            if _listening(port):
                return port
            if time.monotonic() > deadline:
                raise RuntimeError(f"the delaying proxy on 127.0.0.1:{port} did not open")
            time.sleep(0.1)

    def wire_bytes(self) -> int:
        """Bytes that have crossed the link so far, both directions (IP/TCP headers included)."""
        sent = class_bytes(_tc("-s", "class", "show", "dev", DEV))
        return sent.get(TO_B, 0) + sent.get(FROM_B, 0)


def _gso_max_segs() -> int:
    """``lo``'s gso_max_segs now (65535 unless something changed it)."""
    info = json.loads(_ip("-d", "-j", "link", "show", "dev", DEV))
    return int(info[0].get("gso_max_segs", 65535))


def _listening(port: int) -> bool:
    """Something listens on 127.0.0.1:``port`` (from /proc/net/tcp, without connecting)."""
    want = f"0100007F:{port:04X}"
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(f[1] == want and f[3] == "0A" for f in (line.split() for line in lines))


def class_bytes(text: str) -> dict[str, int]:
    """``tc -s class show``'s bytes sent per class id (this iproute2 prints no JSON for classes)."""
    out: dict[str, int] = {}
    current = None
    for line in text.splitlines():
        if m := re.match(r"class \S+ (\S+) ", line):
            current = m.group(1)
        elif current and (m := re.match(r"\s*Sent (\d+) bytes ", line)):
            out[current] = int(m.group(1))
            current = None
    return out
