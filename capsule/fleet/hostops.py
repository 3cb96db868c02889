"""The calls a rollout makes to the fleet's hosts: what each holds and runs (asked of all at once,
within one deadline), a transfer from the origin (this store pushes) or from a host that already holds
the version (the receiving host's agent pulls from it), and activation."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from capsule import hosts, transfer
from capsule.agentclient import AgentClient
from capsule.bounds import VERSION, WIRE_BYTES
from capsule.errors import Error, InvalidName, TransferFailed
from capsule.fleet.members import Member
from capsule.names import parse_ref
from capsule.store import Store
from capsule.store.catalogue import VersionRow
from capsule.transfer.records import version_record

ASK_TIMEOUT = 5.0
TRANSFER_TIMEOUT = 3600.0


@dataclass
class HostView:
    """What one host answered: per capsule its versions and the version running (None: none)."""
    host: str
    reachable: bool
    error: str | None = None
    error_code: str | None = None
    answered_at: float | None = None
    capsules: dict[str, dict[str, Any]] = field(default_factory=dict)

    def holds(self, name: str, version: int) -> bool:
        return version in self.capsules.get(name, {}).get("versions", [])

    def running(self, name: str) -> int | None:
        return self.capsules.get(name, {}).get("running")


def _parse_capsules(answer: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(answer, list):
        raise TransferFailed("malformed /v1/capsules answer: expected a list")
    out: dict[str, dict[str, Any]] = {}
    for c in answer:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("versions"), list):
            raise TransferFailed("malformed /v1/capsules answer")
        versions = [v for v in c["versions"] if VERSION.contains(v)]    # a peer's numbers: bounded
        running = c.get("running") if VERSION.contains(c.get("running")) else None
        out[c["name"]] = {"versions": sorted(versions), "running": running}
    return out


def survey(store: Store, members: list[Member], timeout: float = ASK_TIMEOUT) -> dict[str, HostView]:
    """Ask every member at once who it is (its store id must be the one recorded) and then what it holds
    and runs; each round within ``timeout``."""
    views: dict[str, HostView] = {}
    names = {m.name for m in members}
    for st in hosts.ask_all(store, "/v1/info", timeout=timeout, only=names):
        views[st.peer.name] = HostView(st.peer.name, st.reachable, st.error, st.error_code)
    answering = {h for h, v in views.items() if v.reachable}
    for st in hosts.ask_all(store, "/v1/capsules", timeout=timeout, only=answering) if answering else []:
        view = views[st.peer.name]
        view.reachable, view.error, view.error_code = st.reachable, st.error, st.error_code
        if st.reachable:
            try:
                view.capsules = _parse_capsules(st.answer)
                view.answered_at = time.time()
            except TransferFailed as exc:
                view.reachable, view.error, view.error_code = False, str(exc), exc.code
    return views


def other_content(store: Store, version: VersionRow, claimants: list[Member]) -> dict[str, str]:
    """Of the hosts that list ``version``'s number, those whose record differs from ours (another
    capsule of the same name, or a version made there): host → why. A host that cannot be asked is
    taken at its word (the transfer will tell)."""
    ours = version_record(store, version)
    out = {}
    for m in claimants:
        try:
            with AgentClient(m.peer.url, m.peer.token, timeout=ASK_TIMEOUT, fingerprint=m.peer.fingerprint) as client:
                theirs = client.get_json(f"/v1/capsules/{version.capsule}/versions/{version.number}")
        except Error:
            continue
        if not isinstance(theirs, dict) or theirs.get("chains") != ours["chains"] \
                or theirs.get("memory") != ours["memory"]:
            out[m.name] = (f"{version.ref} already exists on {m.name} with other content: nothing sent "
                           f"(remove it there, or roll out another version)")
    return out


class _Progress(transfer.Progress):
    def __init__(self, on_bytes: Callable[[int], None]) -> None:
        self.on_bytes = on_bytes

    def wire(self, total_wire: int) -> None:
        self.on_bytes(total_wire)


def push_from_origin(store: Store, ref: str, member: Member, on_bytes: Callable[[int], None],
                     opts: transfer.Options | None = None) -> int:
    """This store sends ``ref`` to the member; its wire bytes."""
    return transfer.push(store, ref, member.peer.url, member.peer.token, opts, _Progress(on_bytes)).wire_bytes


GRANT_SECONDS = 3 * 3600   # a fan-out grant outlives the longest pull a rollout waits for


def host_grant(source: Member, name: str, number: int) -> str:
    """A grant the source's agent makes for a host that pulls ``name@number`` from it: to read that version's
    objects and nothing else, expiring; the rollout's own credential for the source never leaves this host."""
    with AgentClient(source.peer.url, source.peer.token, fingerprint=source.peer.fingerprint) as client:
        reply = client.post_json("/v1/grants/host", {"allow": "read", "capsule": name, "version": number,
                                                     "expires_in": GRANT_SECONDS})
    token = reply.get("token") if isinstance(reply, dict) else None
    if not isinstance(token, str):
        raise TransferFailed(f"host {source.name} answered a grant request without a token")
    return token


def pull_from_peer(ref: str, member: Member, source: Member, level: int | None = None,
                   grant: str | None = None) -> int:
    """The member's agent pulls ``ref`` (NAME@V) from ``source``'s agent (given its URL and a read ``grant`` of
    it for that version: :func:`host_grant`), asking for zstd at ``level`` (the agent's default when None);
    wire bytes."""
    if grant is None:
        r = parse_ref(ref)
        if r.version is None:
            raise InvalidName(f"a fleet pull names one version (NAME@V), not {ref!r}")
        grant = host_grant(source, r.name, r.version)
    with AgentClient(member.peer.url, member.peer.token, timeout=TRANSFER_TIMEOUT,
                     fingerprint=member.peer.fingerprint) as client:
        body: dict[str, Any] = {"source": source.peer.url, "token": grant, "ref": ref,
                                "fingerprint": source.peer.fingerprint}
        if level is not None:
            body["zstd_level"] = level
        reply = client.post_json("/v1/fleet/pull", body)
    wire = reply.get("wire_bytes", 0) if isinstance(reply, dict) else 0
    return int(WIRE_BYTES.check(wire, f"{member.name}'s wire_bytes", TransferFailed))


def activate(member: Member, name: str, version: int, timeout: float = 180.0) -> str:
    """Run ``name@version`` on the member (its running older version stopped first); what it did."""
    with AgentClient(member.peer.url, member.peer.token, timeout=timeout + 60,
                     fingerprint=member.peer.fingerprint) as client:
        reply = client.request("POST", f"/v1/capsules/{name}/activate",
                               params={"version": version, "timeout": timeout}).json()
    return str(reply.get("did", "")) if isinstance(reply, dict) else ""


def activity(member: Member) -> dict[str, Any]:
    """The member's recent pulls and what it served (``GET /v1/fleet/activity``)."""
    with AgentClient(member.peer.url, member.peer.token, timeout=ASK_TIMEOUT,
                     fingerprint=member.peer.fingerprint) as client:
        return client.get_json("/v1/fleet/activity")
