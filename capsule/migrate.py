"""``capsule migrate``: suspend here (optionally ballooned), then either push
the version and start it there (``full``), or have the other host start it at
once with its disks paged in from this host (``demand``) — the choices the
paper measured (§5.3).

If anything fails after the suspend, the guest is started again here from
the version just made (unless the other host may already run it), and
:class:`MigrationFailed` says what happened: the version, whether the guest
runs here again, and what reached the other host."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from capsule import lifecycle, transfer
from capsule.agentclient import AgentClient
from capsule.catalogue import VersionRow
from capsule.errors import CapsuleError, Error, InvalidName, RuntimeFailure, Unreachable
from capsule.store import Store
from capsule.units import human

MODES = ("full", "demand")


@dataclass
class MigrateResult:
    mode: str
    suspended: lifecycle.SealResult
    push: transfer.TransferReport | None
    remote: dict[str, Any]
    seconds: float


@dataclass
class Reached:
    """What of a version reached the other host before a migration failed."""

    present: list[str] = field(default_factory=list)    # object ids the other host holds
    missing: list[str] = field(default_factory=list)    # object ids it lacks
    known: bool = True                                   # False: the other host could not be asked
    sent_bytes: int = 0                                  # bytes this host put on the wire
    recorded: bool = False                               # the version was recorded there

    def describe(self, ref: str) -> str:
        sent = f"; {human(self.sent_bytes)} sent" if self.sent_bytes else ""
        if not self.known:
            return f"what of {ref} the other host holds is unknown (it could not be asked){sent}"
        total = len(self.present) + len(self.missing)
        where = "recorded there" if self.recorded else "not recorded there"
        return f"{len(self.present)} of the {total} objects of {ref} are at the other host ({where}){sent}"


class MigrationFailed(CapsuleError):
    """A migration failed after the suspend. Carries the version made here, whether the guest runs here again,
    and what reached the other host; the exit code is the failure's own."""

    fields = ("version", "step", "restored")  # what travels when an agent reports it (see hashcache.errors)

    def __init__(self, message: str, *, version: str = "", step: str = "", restored: bool = False,
                 reached: Reached | None = None, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.version, self.step, self.restored, self.reached, self.cause = version, step, restored, reached, cause
        if cause is not None:
            self.exit_code = cause.exit_code if isinstance(cause, Error) else RuntimeFailure.exit_code


class _Tally(transfer.Progress):
    """Passes progress on and keeps the wire bytes of the push, which a failed push has no report for."""

    def __init__(self, inner: transfer.Progress | None) -> None:
        self.inner = inner or transfer.Progress()
        self.wire_bytes = 0
        self._lock = threading.Lock()

    def begin(self, label: str, total: int) -> None:
        self.inner.begin(label, total)

    def advance(self, n: int) -> None:
        self.inner.advance(n)

    def wire(self, total_wire: int) -> None:
        with self._lock:
            self.wire_bytes = max(self.wire_bytes, total_wire)
        self.inner.wire(total_wire)


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
    tally = _Tally(progress)
    step = "push" if mode == "full" else "run"
    try:
        with AgentClient(to, token, timeout=900.0) as client:
            if mode == "full":
                say(f"pushing {ref}")
                pushed = transfer.push(store, ref, to, token, progress=tally)
                step = "start"
                say("starting it there")
                remote = client.request("POST", f"/v1/capsules/{name}/start",
                                        params={"version": sealed.version.number}).json()
            else:
                say("starting it there, disks on demand from here")
                remote = client.post_json("/v1/run", {"source": source_url, "token": source_token, "ref": ref,
                                                      "prefetch": prefetch})
    except BaseException as exc:
        failure = _fail_back(store, sealed.version, to, token, step, exc, pushed, tally, say)
        if not isinstance(exc, Exception):
            raise  # an interrupt stays an interrupt; the guest runs here again if it safely could
        raise failure from exc
    return MigrateResult(mode, sealed, pushed, remote, time.monotonic() - t0)


def _may_run_there(step: str, exc: BaseException) -> bool:
    """Whether the other host may have started the guest: only when the start (or run) request may have reached
    it and no answer came back. A refusal from the agent, or a connection never made, means it did not."""
    if step == "push":
        return False
    if isinstance(exc, Unreachable):
        # a refused connection never reached it
        return not (getattr(exc, "refused", False) or isinstance(exc.__cause__, httpx.ConnectError))
    return not isinstance(exc, Error)  # a typed error is the agent's answer: it did not start the guest


def _fail_back(store: Store, version: VersionRow, to: str, token: str, step: str, exc: BaseException,
               pushed: transfer.TransferReport | None, tally: _Tally, say: Callable[[str], None]) -> MigrationFailed:
    ref = version.ref
    what = {"push": f"pushing {ref} to {to}", "start": f"starting {ref} at {to}",
            "run": f"starting {ref} at {to} (disks on demand from here)"}[step]
    lines = [f"migrating {version.capsule} failed while {what}: {exc or type(exc).__name__}",
             f"the guest's state was saved here as {ref}"]
    restored = False
    if _may_run_there(step, exc):
        lines.append(f"it was NOT started again here: {to} may have started it before the connection broke. "
                     f"Check there; if it does not run, `capsule start {ref}` here")
    else:  # first the guest, then the questions
        say(f"starting {ref} here again")
        try:
            lifecycle.start(store, ref, wait=False)
            restored = True
            lines.append(f"the guest runs here again from {ref}")
        except Error as again:
            lines.append(f"starting it again here failed too ({again}); `capsule start {ref}` retries")
    # an interrupt is re-raised as it is: do not keep the user waiting on the other host
    reached = _reached(store, version, to, token) if isinstance(exc, Exception) else Reached(known=False)
    reached.sent_bytes = pushed.wire_bytes if pushed else tally.wire_bytes
    reached.recorded = reached.recorded or bool(pushed and pushed.recorded)
    lines.append(reached.describe(ref))
    return MigrationFailed("; ".join(lines), version=ref, step=step, restored=restored, reached=reached, cause=exc)


def _reached(store: Store, version: VersionRow, to: str, token: str) -> Reached:
    layers = list(dict.fromkeys(lid for chain in version.chains for lid in chain))
    files = [version.config["kernel"], version.config["initrd"], *([version.memory] if version.memory else [])]
    try:
        with AgentClient(to, token, timeout=30.0) as client:
            missing = client.post_json("/v1/objects/missing", {"layers": layers, "files": files})
            lacking = set(missing.get("layers", [])) | set(missing.get("files", []))
            recorded = True
            try:
                client.get_json(f"/v1/capsules/{version.capsule}/versions/{version.number}")
            except Error:
                recorded = False
    except (Error, httpx.HTTPError, ValueError, AttributeError, TypeError):
        return Reached(known=False)
    ids = layers + files
    return Reached(present=[x for x in ids if x not in lacking], missing=[x for x in ids if x in lacking],
                   recorded=recorded)
