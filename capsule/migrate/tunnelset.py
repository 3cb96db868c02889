"""A tunnel set to one peer: one call opens a session on the peer's agent and an entrance here for each kind
(:class:`~capsule.migrate.tunnel.Tunnel`), and gives what ``virsh migrate --p2p --live`` takes (see
:mod:`capsule.migrate.tunnel` for the whole)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsule import __version__
from capsule.agentclient import AgentClient
from capsule.errors import Error, InvalidName, NotFound
from capsule.migrate.memdelta import FEATURE as DELTA_FEATURE
from capsule.migrate.memknown import Known, Objects
from capsule.migrate.ramdedup import Stats
from capsule.migrate.streampack import FEATURE as PACK_FEATURE
from capsule.migrate.streampack import PACKABLE, PackStats
from capsule.migrate.switchover import Tail
from capsule.migrate.tunnel import (
    CONNECT_TIMEOUT,
    DEDUP_FEATURE,
    DEDUP_KIND,
    DEFAULT_TTL,
    ENTRANCE_DIR_MODE,
    KINDS,
    QEMU_KINDS,
    RUNS_FEATURE,
    Endpoint,
    Tunnel,
)
from capsule.runtime import guestaccess
from hashcache.transport import protocol


@dataclass(frozen=True)
class Dedup:
    """The memory codec's terms for one move: ``objects`` (kind, id) the peer holds, ``known`` their hashes."""

    objects: Objects
    known: Known


@dataclass
class Tunnels:
    """A tunnel set to one peer (see the module's docstring): its URIs for libvirt, and :meth:`close`."""

    peer: Endpoint
    session: str
    tunnels: dict[str, Tunnel]
    remote_paths: dict[str, str]         # kind → the path the destination chose (qemu-* kinds)
    private_dir: Path | None = None      # where the libvirt entrance is (removed on close)
    made_dirs: list[Path] = field(default_factory=list)
    dedup: bool = False                  # the peer decodes the memory codec on qemu-migration

    @property
    def memory(self) -> Stats:
        """The memory codec's figures (all zero when it is not applied)."""
        t = self.tunnels.get(DEDUP_KIND)
        return t.memory if t is not None else Stats()

    @property
    def disks(self) -> PackStats:
        """What the disks' channel packed (zero when the peer does not unpack it)."""
        t = self.tunnels.get("qemu-disks")
        return t.packed if t is not None else PackStats()

    @property
    def switchover(self) -> Tail | None:
        """What the pre-copy switchover carried on the migration channel, and every channel since the stop (call
        it once libvirt's migration returned); None: not seen, or no codec."""
        t = self.tunnels.get(DEDUP_KIND)
        watch = next((w for w in list(t.tails) if w.tail is not None), None) if t is not None else None
        if watch is None:
            return None
        watch.settle()
        return watch.tail

    def counters(self) -> dict[str, int]:
        """Bytes each channel carried so far, both ways."""
        return {kind: t.bytes_sent + t.bytes_received for kind, t in self.tunnels.items()}

    def _path(self, kind: str) -> Path | None:
        return self.tunnels[kind].path if kind in self.tunnels else None

    @property
    def libvirt_uri(self) -> str | None:
        p = self._path("libvirt")
        return None if p is None else f"qemu+unix:///system?socket={p}"

    @property
    def migration_uri(self) -> str | None:
        p = self._path("qemu-migration")
        return None if p is None else f"unix://{p}"

    @property
    def disks_uri(self) -> str | None:
        p = self._path("qemu-disks")
        return None if p is None else f"unix://{p}"

    @property
    def bytes_sent(self) -> int:
        return sum(t.bytes_sent for t in self.tunnels.values())

    @property
    def bytes_received(self) -> int:
        return sum(t.bytes_received for t in self.tunnels.values())

    def __enter__(self) -> Tunnels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Every entrance closed, the session deleted on the peer (a peer gone by then is let be: its session
        expires there)."""
        for t in self.tunnels.values():
            t.close()
        for d in [*self.made_dirs, *([self.private_dir] if self.private_dir else [])]:
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(Error), _client(self.peer) as client:
            client.request("DELETE", f"/v1/tunnel/{self.session}", idempotent=False)


def _client(peer: Endpoint) -> AgentClient:
    return AgentClient(peer.url, peer.token, timeout=CONNECT_TIMEOUT, fingerprint=peer.fingerprint)


def _entrance_dir(d: Path) -> Path:
    """``d`` made (if missing) as a directory the QEMU user may pass but not list."""
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    gid = guestaccess.socket_group()
    if gid is not None:
        os.chown(d, -1, gid)
    os.chmod(d, ENTRANCE_DIR_MODE)
    guestaccess.check_reachable(d)
    return d


def open_tunnels(peer: Endpoint, kinds: tuple[str, ...] = KINDS, *, ttl: float = DEFAULT_TTL,
                 local_dir: Path | None = None, dedup: Dedup | None = None) -> Tunnels:
    """A tunnel session on ``peer`` with a channel per kind and an entrance here for each (see the module's
    docstring). ``ttl``: how long the peer admits new connections; ``dedup``: the memory codec on
    qemu-migration, if the peer takes it. Raises ProtocolMismatch for a peer without the tunnel, the peer's own
    errors (AuthFailed, Forbidden, ...) as they come."""
    if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds):
        raise InvalidName(f"tunnel kinds {list(kinds)!r}: give some of {', '.join(KINDS)}, each once")
    body: dict[str, Any] = {"kinds": list(kinds), "ttl": ttl}
    if dedup is not None and DEDUP_KIND in kinds:
        body["dedup"] = {"objects": [[k, o] for k, o in dedup.objects]}
    if packed := [k for k in kinds if k in PACKABLE]:
        body["pack"] = packed
    with _client(peer) as client:
        try:
            try:
                answer = client.post_json("/v1/tunnel", body)
            except InvalidName:
                lacks = [key for key, feature in (("dedup", DEDUP_FEATURE), ("pack", PACK_FEATURE))
                         if key in body and feature not in client.features]
                if not lacks:
                    raise
                for key in lacks:                       # a peer without the codec: the bytes as they came
                    del body[key]
                answer = client.post_json("/v1/tunnel", body)
        except NotFound:
            protocol.require(client.peer, client.features, "tunnel", __version__, f"the agent at {peer.url}",
                             "a live move")
            raise
        runs = RUNS_FEATURE in client.features
        delta = DELTA_FEATURE in client.features
    try:
        session = str(answer["session"])
        remote = {k: str(answer["channels"][k]["path"]) for k in kinds if k in QEMU_KINDS}
    except (KeyError, TypeError) as exc:
        raise InvalidName(f"the agent at {peer.url} answered the tunnel request without {exc}") from None
    out = Tunnels(peer, session, {}, remote, dedup=dedup is not None and answer.get("dedup") is True)
    unpacks = answer.get("pack") if "pack" in body else None
    pack = {k for k in unpacks if isinstance(k, str)} & set(PACKABLE) if isinstance(unpacks, list) else set()
    try:
        for kind in kinds:
            if kind == "libvirt":
                out.private_dir = _entrance_dir(Path(tempfile.mkdtemp(prefix="capsule-tunnel-")))
                path = out.private_dir / "libvirt.sock"
            elif local_dir is not None:
                path = _entrance_dir(Path(local_dir)) / f"{kind}.sock"
            else:
                path = Path(remote[kind])
                if not path.is_absolute() or ".." in path.parts:
                    raise InvalidName(f"the agent at {peer.url} chose a tunnel path that is no absolute path: "
                                      f"{str(path)[:120]!r}")
                if not path.parent.exists():
                    out.made_dirs.append(path.parent)
                _entrance_dir(path.parent)
            out.tunnels[kind] = Tunnel(peer, session, kind, path,
                                       known=dedup.known if out.dedup and kind == DEDUP_KIND and dedup else None,
                                       runs=runs, delta=delta, pack=kind in pack)
        if (migration := out.tunnels.get(DEDUP_KIND)) is not None:
            migration.counters = out.counters
    except BaseException:
        out.close()
        raise
    return out
