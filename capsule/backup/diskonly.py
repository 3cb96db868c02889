"""``--disk-only`` backups: the disks' state without a memory image, while the guest keeps running.

1. freeze the guest's file systems through the capsule agent (``fs.freeze``); a guest whose agent does
   not answer is not frozen: its backup is *crash-consistent* and recorded as such;
2. switch every disk to a fresh leaf on top of its current one, seal the old leaves and record the new
   (inactive) version and the instance on its new leaves (:func:`capsule.lifecycle.livedisk.seal_disks_running`);
3. thaw right after the switch. The guest's file systems were frozen only for the switch: that is the pause
   reported."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from capsule.errors import Error
from capsule.lifecycle import livedisk
from capsule.runtime.guestagent import AgentError, AgentUnavailable, GuestAgent
from capsule.store import Store
from capsule.store.catalogue import InstanceRow, LayerRow, VersionRow

FREEZE_TIMEOUT = 10.0


@dataclass
class DiskSnapshot:
    version: VersionRow
    layers: list[LayerRow]
    pause: float            # seconds the file systems were frozen (or the switch took, unfrozen)
    consistency: str        # "frozen" or "crash-consistent"
    agent_error: str | None = None


def _freeze(sock: Path) -> tuple[GuestAgent | None, str | None]:
    try:
        agent = GuestAgent(sock, timeout=FREEZE_TIMEOUT)
    except AgentUnavailable as exc:
        return None, str(exc)
    try:
        agent.freeze(FREEZE_TIMEOUT)
    except (AgentUnavailable, AgentError) as exc:
        with contextlib.suppress(Error):
            agent.thaw()
        agent.close()
        return None, str(exc)
    return agent, None


def _thaw(agent: GuestAgent | None) -> None:
    if agent is None:
        return
    try:
        agent.thaw()
    finally:
        agent.close()


def snapshot(store: Store, name: str, note: Callable[[str], str]) -> DiskSnapshot:
    """Take a disk-only backup of running capsule ``name`` (see the module's description); ``note(consistency)``
    is the new version's note. The capsule is claimed ("being backed up") throughout; the guest's freeze and
    thaw are waited for without the store lock."""
    frozen: dict[str, GuestAgent | str | None] = {"agent": None, "error": None}

    def hold(inst: InstanceRow) -> Callable[[], None]:
        agent, error = _freeze(Path(inst.dir) / "agent.sock")
        frozen.update(agent=agent, error=error)
        done = [False]

        def thaw() -> None:
            if not done[0]:
                done[0] = True
                _thaw(agent)
        return thaw

    def consistency() -> str:
        return "frozen" if frozen["agent"] is not None else "crash-consistent"

    r = livedisk.seal_disks_running(store, name, lambda: note(consistency()), hold=hold, doing="being backed up")
    error = frozen["error"]
    return DiskSnapshot(r.version, r.layers, r.pause, consistency(), error if isinstance(error, str) else None)
