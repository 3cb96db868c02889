"""Ballooning before a memory image is saved (§4.1), and giving the memory
back after it is restored.

Two ways to turn guest memory into zero pages (holes in a ``sparse`` memory
image, nothing on the wire):

- ``agent``: the guest agent drops clean page cache (policy ``cache`` or
  ``aggressive``; ``none`` keeps it), then allocates and writes every page
  until §4.1's stop rule (free swap falls by > 1 MB) or a MemAvailable floor;
- ``virtio``: the host inflates the virtio-balloon device (libvirt
  set-memory) down to what the guest uses, as the agent reports it.

Guest free-page reporting is on by default (the domain's memballoon has
``freePageReporting``): free pages the guest reports are discarded by QEMU.
A guest without an agent still suspends, only without ballooning.

Measured (B2, Debian 512 MiB desktop-like guest, HCP wire bytes): none 57.1 MB,
agent balloon 34.8 MB, virtio balloon 17.8 MB, primed hash cache 16.9 MB;
without free-page reporting "none" is 67.0 MB. Hence the default: virtio,
with the agent dropping clean page cache first."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import libvirt

from capsule.errors import InvalidName
from capsule.runtime.guestagent import AgentError, AgentUnavailable, GuestAgent, Reply

POLICIES = ("none", "cache", "aggressive")
METHODS = ("agent", "virtio")
DEFAULT_POLICY = "cache"
DEFAULT_METHOD = "virtio"   # measured best in bench/balloon_bench.py (B2): half the wire bytes of "agent"
AGENT_TIMEOUT = 3.0          # connect + ping budget: a guest without an agent costs at most this
INFLATE_TIMEOUT = 30.0
HOLD_SAFETY_S = 300          # the agent gives the memory back by itself after this much guest time
VIRTIO_MARGIN_MIB = 48


@dataclass
class BalloonResult:
    method: str
    policy: str
    held_bytes: int = 0
    stop_reason: str | None = None
    seconds: float = 0.0
    skipped: str | None = None       # why nothing was ballooned

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check(policy: str, method: str) -> None:
    if policy not in POLICIES:
        raise InvalidName(f"unknown balloon policy {policy!r}: choose one of {', '.join(POLICIES)}")
    if method not in METHODS:
        raise InvalidName(f"unknown balloon method {method!r}: choose one of {', '.join(METHODS)}")


def inflate(agent_sock: Path, dom: libvirt.virDomain, policy: str, method: str) -> BalloonResult:
    """Balloon the running guest; never raises for a missing, silent or misbehaving agent (what it answers is
    checked: a malformed reply skips the balloon like a missing agent)."""
    check(policy, method)
    t0 = time.monotonic()
    result = BalloonResult(method, policy)
    try:
        with GuestAgent(agent_sock, timeout=AGENT_TIMEOUT) as agent:
            agent.ping()
            if method == "agent":
                r = Reply(agent.inflate(policy=policy, timeout_s=INFLATE_TIMEOUT, hold_s=HOLD_SAFETY_S),
                          "balloon.inflate")
                result.held_bytes, result.stop_reason = (r.integer("held_bytes", hi=dom.maxMemory() << 10, default=0),
                                                         r.text("stop_reason", 200, default=None, nullable=True))
            else:
                if policy != "none":
                    agent.call("balloon.inflate", {"policy": policy, "max_bytes": 0}, timeout=INFLATE_TIMEOUT)
                stats = Reply(agent.stats(), "stats")
                result.held_bytes, result.stop_reason = _virtio_inflate(
                    dom, stats.integer("MemTotal", default=0), stats.integer("MemAvailable", default=0))
    except (AgentUnavailable, AgentError) as exc:
        result.skipped = str(exc)
    result.seconds = time.monotonic() - t0
    return result


def _virtio_inflate(dom: libvirt.virDomain, total: int, available: int) -> tuple[int, str]:
    """Shrink the guest through the virtio-balloon device to what it uses (``total`` - ``available`` bytes, as
    it says) plus a margin."""
    max_kib = dom.maxMemory()
    used_kib = max(0, total - available) // 1024
    target = max(used_kib + VIRTIO_MARGIN_MIB * 1024, 64 * 1024)
    if target >= max_kib:
        return 0, "nothing to take"
    dom.setMemoryFlags(target, libvirt.VIR_DOMAIN_AFFECT_LIVE)
    deadline = time.monotonic() + INFLATE_TIMEOUT
    actual = max_kib
    while time.monotonic() < deadline:
        actual = int(dom.memoryStats().get("actual", max_kib))
        if actual <= target + 1024:
            return (max_kib - actual) * 1024, "target"
        time.sleep(0.2)
    return (max_kib - actual) * 1024, "timeout"


def give_back(agent_sock: Path, dom: libvirt.virDomain | None, info: dict[str, Any] | None) -> None:
    """After a restore (or a failed save): deflate, so the guest has all its memory again."""
    if dom is not None:
        with contextlib.suppress(libvirt.libvirtError):
            max_kib = dom.maxMemory()
            if int(dom.info()[2]) < max_kib:
                dom.setMemoryFlags(max_kib, libvirt.VIR_DOMAIN_AFFECT_LIVE)
    if info and info.get("method") == "agent" and info.get("held_bytes"):
        with contextlib.suppress(AgentUnavailable, AgentError), GuestAgent(agent_sock, timeout=5.0) as agent:
            agent.deflate()
