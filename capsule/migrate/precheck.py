"""Before a live move: every reason it would fail, found in well under a second, each one a user can act on.

Here: the capsule runs on this host, on local disks, not half-way through an update; its domain XML names
nothing that cannot move (host devices, shared memory, a host directory, a CPU passed through from this
host). There: the agent answers, receives live moves (``live-move`` and ``tunnel`` in its
``X-Capsule-Features``), and has no reason of its own to refuse (``POST /v1/live/check``: the capsule
running there already, a CPU it lacks, being this machine's own libvirt — two agents on one machine, where a live
move cannot happen: ``same_host``, found by libvirt's host UUID, which this side sends)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import libvirt

from capsule.agentclient import AgentClient
from capsule.errors import Error
from capsule.lifecycle import USER_NETWORK, demand
from capsule.runtime.connection import host_uuid, lookup_domain
from capsule.store import Store

FEATURE = "live-move"
TIMEOUT = 10.0


@dataclass(frozen=True)
class Refusal:
    reason: str      # a short code: not_running, hostdev, cpu_passthrough, no_live_moves, ...
    detail: str      # what is wrong and what to do about it

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Target:
    """The destination agent: its URL, token and pinned certificate fingerprint (None: http, or CA-signed)."""

    url: str
    token: str
    fingerprint: str | None = None


_DEVICES = {
    "hostdev": ("hostdev", "a host device is passed through to it (<hostdev>), which cannot leave this host"),
    "shmem": ("shmem", "it shares memory with this host (<shmem>)"),
    "filesystem": ("filesystem", "a directory of this host is mounted in it (<filesystem>)"),
    "redirdev": ("redirdev", "a USB device is redirected to it (<redirdev>)"),
    "smartcard": ("smartcard", "a smartcard of this host is passed to it (<smartcard>)"),
}


def xml_refusals(xml: str) -> list[Refusal]:
    """What in a running domain's XML cannot move live to another host."""
    root = ET.fromstring(xml)
    out: list[Refusal] = []
    devices = root.find("devices")
    for el in list(devices) if devices is not None else []:
        tag = el.tag
        if tag == "interface" and el.get("type") == "hostdev":
            tag = "hostdev"
        if tag in _DEVICES:
            reason, what = _DEVICES[tag]
            if all(r.reason != reason for r in out):
                out.append(Refusal(reason, f"{what}: remove it, or stop the capsule and move it with --offline"))
    cpu = root.find("cpu")
    if cpu is not None and cpu.get("mode") == "host-passthrough":
        out.append(Refusal("cpu_passthrough", "its CPU is this host's passed through (host-passthrough): another "
                                              "host's CPU differs; move it with --offline"))
    return out


def local_refusals(store: Store, name: str) -> tuple[list[Refusal], str | None]:
    """Reasons on this host, and the running domain's migratable XML (None when it does not run)."""
    cap = store.catalogue.capsule(name)
    if cap is None:
        return [Refusal("not_found", f"there is no capsule {name!r} here (`capsule ls`)")], None
    inst = store.catalogue.instance(name)
    dom = lookup_domain(inst.domain) if inst is not None else None
    if inst is None or dom is None or not dom.isActive():
        return [Refusal("not_running", f"{name} does not run here: `capsule start {name}`, or move it stopped "
                                       f"with `capsule push`")], None
    out: list[Refusal] = []
    if (Path(inst.dir) / USER_NETWORK).exists():
        out.append(Refusal("updating", f"{name} runs an update (`capsule update make`): move it when that is done"))
    if any(demand.chain_needs_server(store, chain) for chain in inst.chains):
        out.append(Refusal("remote_disks", f"{name}'s disks are still paged in from another host: wait until they "
                                           "are all here (`capsule ls` shows it), or move it with --offline"))
    state, _ = dom.state()
    if state not in (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_PAUSED):
        out.append(Refusal("not_running", f"{name}'s guest is not running (libvirt state {state})"))
    xml = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_MIGRATABLE)
    return out + xml_refusals(xml), xml


def remote_refusals(name: str, xml: str, target: Target) -> tuple[list[Refusal], dict[str, Any]]:
    """Reasons the destination gives (and its answer to the check: post-copy, its host UUID)."""
    root = ET.fromstring(xml)
    cpu = root.find("cpu")
    body = {"capsule": name, "type": root.get("type", ""),
            "cpu": ET.tostring(cpu, encoding="unicode") if cpu is not None else "", "host": host_uuid() or ""}
    try:
        with AgentClient(target.url, target.token, timeout=TIMEOUT, fingerprint=target.fingerprint) as client:
            info = client.get_json("/v1/info")
            if not {FEATURE, "tunnel"} <= client.features:     # named on every answer (X-Capsule-Features)
                return [Refusal("no_live_moves", f"the agent at {target.url} (release {info.get('version', '?')}) "
                                                 "does not receive live moves: upgrade it, or move with "
                                                 "--offline")], {}
            answer = client.post_json("/v1/live/check", body)
    except Error as exc:
        return [Refusal("unreachable", f"the agent at {target.url} did not answer the check: {exc}")], {}
    got = answer.get("refusals") if isinstance(answer, dict) else None
    if not isinstance(got, list):
        return [Refusal("unreachable", f"the agent at {target.url} gave a malformed answer to the check")], {}
    return [Refusal(str(r.get("reason", "refused"))[:64], str(r.get("detail", ""))[:500])
            for r in got if isinstance(r, dict)], answer


def precheck(store: Store, name: str, peer: Target) -> list[Refusal]:
    """Every reason a live move of ``name`` to ``peer`` would be refused (empty: it may go)."""
    refusals, xml = local_refusals(store, name)
    if xml is None:
        return refusals
    there, _answer = remote_refusals(name, xml, peer)
    return refusals + there
