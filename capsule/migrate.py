"""``capsule migrate``: suspend here (optionally ballooned), then either push
the version and start it there (``full``), or have the other host start it at
once with its disks paged in from this host (``demand``) — the choices the
paper measured (§5.3)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capsule import lifecycle, transfer
from capsule.agentclient import AgentClient
from capsule.errors import InvalidName
from capsule.store import Store

MODES = ("full", "demand")


@dataclass
class MigrateResult:
    mode: str
    suspended: lifecycle.SealResult
    push: transfer.TransferReport | None
    remote: dict[str, Any]
    seconds: float


def migrate(store: Store, name: str, to: str, token: str, *, mode: str = "full", balloon: str | None = None,
            balloon_method: str = "virtio", source_url: str | None = None, source_token: str | None = None,
            prefetch: bool = False, progress: transfer.Progress | None = None,
            say: Callable[[str], None] = lambda _m: None) -> MigrateResult:
    if mode not in MODES:
        raise InvalidName(f"unknown migration mode {mode!r}: choose full or demand")
    if mode == "demand" and not (source_url and source_token):
        raise InvalidName("--mode demand needs --source-url (this host's agent, reachable from the other host) "
                          "and its token")
    t0 = time.monotonic()
    say("suspending here")
    sealed = lifecycle.suspend(store, name, balloon=balloon, balloon_method=balloon_method, say=say)
    assert sealed.version is not None
    ref = sealed.version.ref
    pushed = None
    with AgentClient(to, token, timeout=900.0) as client:
        if mode == "full":
            say(f"pushing {ref}")
            pushed = transfer.push(store, ref, to, token, progress=progress)
            say("starting it there")
            remote = client.request("POST", f"/v1/capsules/{name}/start",
                                    params={"version": sealed.version.number}).json()
        else:
            say("starting it there, disks on demand from here")
            remote = client.post_json("/v1/run", {"source": source_url, "token": source_token, "ref": ref,
                                                  "prefetch": prefetch})
    return MigrateResult(mode, sealed, pushed, remote, time.monotonic() - t0)
