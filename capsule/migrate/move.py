"""``capsule migrate``: suspend here (optionally ballooned), then either push
the version and start it there (``full``), or push only its memory image and
have the other host start it at once with its disks paged in from this host
(``demand``) — the choices the paper measured (§5.3). The CLI and the
dashboard make this one call.

It reports phases (balloon, save, memory, disk, resume) with the bytes on the
wire and the bytes the other host found locally, only ever forward (see
:mod:`capsule.migrate.progress`), and can be cancelled until the other host is
asked to start it.

If anything fails after the suspend, or it is cancelled, the guest is started
again here from the version just made (unless the other host may already run
it), and :class:`MigrationFailed` (:class:`MigrationCancelled`) says what
happened: the version, whether the guest runs here again, and what reached
the other host."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import httpx

from capsule import lifecycle, transfer
from capsule.agentclient import AgentClient
from capsule.errors import Cancelled, CapsuleError, Error, InvalidName, RuntimeFailure, Unreachable
from capsule.migrate.progress import CancelToken, Snapshot, Tracker, planned
from capsule.store import Store, claims
from capsule.store.catalogue import VersionRow
from capsule.units import human
from hashcache.bounds import Bound

MODES = ("full", "demand")
MAX_PAUSE = Bound(0.01, 60, integer=False, unit="seconds")   # a live move's longest pause (libvirt's max downtime)
RECOVER_TIMEOUT = Bound(1, 3600, integer=False, unit="seconds")   # a post-copy's wait for its broken link


@dataclass
class MigrateResult:
    mode: str
    suspended: lifecycle.SealResult
    push: transfer.TransferReport | None
    remote: dict[str, Any]
    seconds: float
    last: Snapshot | None = None      # the last progress event (outcome "done")
    live: Any = None                  # a live move's figures (capsule.migrate.live.LiveFigures)


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
            self.exit_code = cause.exit_code if isinstance(cause, Error) else RuntimeFailure.exit_code  # type: ignore[misc]


class MigrationCancelled(MigrationFailed):
    """A migration was cancelled (from the page, or Ctrl-C) before the other host was asked to start it. The
    guest runs here again (``restored``), from the version the suspend made if it got that far."""

    code = "migration_cancelled"
    http_status = 409


@dataclass
class Steps:
    """The steps of a migration that act on guests and hosts (the real ones by default; tests replace them)."""

    suspend: Callable[..., lifecycle.SealResult] = lifecycle.suspend
    push: Callable[..., transfer.TransferReport] = transfer.push
    restore: Callable[..., Any] = lifecycle.start

    @staticmethod
    def claim(store: Store, name: str) -> AbstractContextManager[Any]:
        """The capsule claimed for the whole migration: nothing else starts, stops or removes it meanwhile."""
        return claims.claim(store, name, "migrating")

    @staticmethod
    def start_there(to: str, token: str, name: str, number: int, fingerprint: str | None = None) -> dict[str, Any]:
        with AgentClient(to, token, timeout=900.0, fingerprint=fingerprint) as client:
            return client.request("POST", f"/v1/capsules/{name}/start", params={"version": number}).json()

    @staticmethod
    def run_there(to: str, token: str, body: dict[str, Any], fingerprint: str | None = None) -> dict[str, Any]:
        with AgentClient(to, token, timeout=900.0, fingerprint=fingerprint) as client:
            return client.post_json("/v1/run", body)

    @staticmethod
    def sizes(store: Store, version: VersionRow, mode: str) -> dict[str, int]:
        return _phase_totals(store, version, mode)

    @staticmethod
    def reached(store: Store, version: VersionRow, to: str, token: str, fingerprint: str | None = None) -> Reached:
        return _reached(store, version, to, token, fingerprint)


def _phase_totals(store: Store, version: VersionRow, mode: str) -> dict[str, int]:
    """Raw bytes each transfer phase accounts for: the memory image; the disk layers with kernel and initrd
    (in demand mode, kernel and initrd travel with the memory image and the disks stay here)."""
    memory = transfer.raw_size(store, "file", version.memory) if version.memory else 0
    boot = sum(transfer.raw_size(store, "file", version.config[k]) for k in ("kernel", "initrd"))
    if mode == "demand":
        return {"memory": memory + boot}
    layers = dict.fromkeys(lid for chain in version.chains for lid in chain)
    return {"memory": memory, "disk": boot + sum(transfer.raw_size(store, "layer", lid) for lid in layers)}


def migrate(store: Store, name: str, to: str, token: str, *, mode: str = "full", balloon: str | None = None,
            balloon_method: str = "virtio", source_url: str | None = None, source_token: str | None = None,
            prefetch: bool = False, say: Callable[[str], None] = lambda _m: None,
            on_event: Callable[[Snapshot], None] = lambda _s: None, cancel: CancelToken | None = None,
            to_name: str | None = None, steps: Steps | None = None, fingerprint: str | None = None,
            source_fingerprint: str | None = None, live: bool = False, max_pause: float = 1.0,
            postcopy: bool = False, recover_timeout: float = 120.0) -> MigrateResult:
    """Move the running capsule ``name`` to the agent at ``to`` (over https its certificate pinned to
    ``fingerprint``, else to the known host's at ``to``; in demand mode the other host pins this one's
    ``source_fingerprint``, by default this store's own host key). ``on_event`` gets a :class:`Snapshot` as
    each phase begins and as bytes move (see :mod:`capsule.migrate.progress`); ``cancel`` stops it before
    the other host is asked to start it (:class:`MigrationCancelled`, the guest running here again).

    ``live``: the guest keeps running here while it moves and pauses at most ``max_pause`` seconds (see
    :mod:`capsule.migrate.live`; ``postcopy``: asked for, switch to post-copy when pre-copy does not converge —
    if the link breaks during post-copy, the post-copy resumes when it returns within ``recover_timeout`` seconds,
    else the guest boots here from its disks as they were at the switchover, see :mod:`capsule.migrate.recover`);
    ``mode`` and ballooning do not apply (:mod:`capsule.migrate.choice` decides which
    kind a request asks for)."""
    if live:
        return _migrate_live(store, name, to, token, max_pause=max_pause, postcopy=postcopy,
                             recover_timeout=recover_timeout, say=say,
                             on_event=on_event, cancel=cancel, to_name=to_name, fingerprint=fingerprint)
    if mode not in MODES:
        raise InvalidName(f"unknown migration mode {mode!r}: choose full or demand")
    if mode == "demand" and not (source_url and source_token):
        raise InvalidName("--mode demand needs --source-url (this host's agent, reachable from the other host) "
                          "and its token")
    from capsule import hosts

    steps = steps or Steps()
    pin = hosts.pin_for(store, to, fingerprint)
    if mode == "demand" and source_fingerprint is None and str(source_url).startswith("https://"):
        source_fingerprint = own_fingerprint(store)
    cancel = cancel or CancelToken()
    tracker = Tracker(name, to_name or to, planned(mode, balloon is not None), on_event)
    t0 = time.monotonic()

    def phase(p: str) -> None:
        cancel.check()
        tracker.enter(p, {"balloon": "ballooning", "save": "saving the memory image"}.get(p, p))

    with steps.claim(store, name):
        say("suspending here")
        try:
            sealed = steps.suspend(store, name, balloon=balloon, balloon_method=balloon_method, say=say, phase=phase)
        except Cancelled as exc:  # before the save: the guest never stopped
            tracker.finish("cancelled", "source", f"cancelled; {name} keeps running here")
            raise MigrationCancelled(f"migrating {name} was cancelled before the suspend; it keeps running here",
                                     step="save", restored=True, cause=exc) from exc
        except BaseException as exc:
            tracker.finish("failed", "source", f"suspending {name} failed: {exc}")
            raise
        assert sealed.version is not None
        version = sealed.version
        ref = version.ref
        tracker.set_version(ref)
        tracker.totals(steps.sizes(store, version, mode))
        pushed = None
        step = "push"
        try:
            phase("memory")
            say(f"pushing {ref}" if mode == "full" else f"pushing the memory image of {ref}")
            if mode == "full":
                pushed = steps.push(store, ref, to, token, progress=tracker, check=cancel.check, fingerprint=pin)
            else:
                steps.push(store, ref, to, token, progress=tracker, check=cancel.check, files_only=True,
                           fingerprint=pin)
            cancel.commit()
            tracker.no_return()
            tracker.enter("resume", f"starting it at {to_name or to}")
            if mode == "full":
                step = "start"
                say("starting it there")
                remote = steps.start_there(to, token, name, version.number, pin)
            else:
                step = "run"
                say("starting it there, disks on demand from here")
                remote = steps.run_there(to, token, {"source": source_url, "token": source_token, "ref": ref,
                                                     "prefetch": prefetch, "fingerprint": source_fingerprint}, pin)
        except BaseException as exc:
            failure = _fail_back(store, version, to, token, step, exc, pushed, tracker, say, steps, pin)
            outcome = "cancelled" if isinstance(failure, MigrationCancelled) else "failed"
            tracker.finish(outcome, "source" if failure.restored else "unknown", str(failure))
            if not isinstance(exc, Exception):
                raise  # an interrupt stays an interrupt; the guest runs here again if it safely could
            raise failure from exc
        seconds = time.monotonic() - t0
        last = tracker.finish("done", "destination", f"{name} runs at {to_name or to} after {seconds:.1f}s")
        return MigrateResult(mode, sealed, pushed, remote, seconds, last)


def _migrate_live(store: Store, name: str, to: str, token: str, *, max_pause: float, postcopy: bool,
                  recover_timeout: float,
                  say: Callable[[str], None], on_event: Callable[[Snapshot], None], cancel: CancelToken | None,
                  to_name: str | None, fingerprint: str | None) -> MigrateResult:
    from capsule import bounds, hosts
    from capsule.migrate import live

    max_pause = float(bounds.check(MAX_PAUSE, max_pause, "max pause"))
    recover_timeout = float(bounds.check(RECOVER_TIMEOUT, recover_timeout, "recover timeout"))
    pin = hosts.pin_for(store, to, fingerprint)
    cancel = cancel or CancelToken()
    tracker = Tracker(name, to_name or to, planned("live", postcopy), on_event)
    t0 = time.monotonic()
    try:
        moved = live.move(store, name, to, token, max_pause=max_pause, postcopy=postcopy, pin=pin,
                          recover_timeout=recover_timeout,
                          tracker=tracker, cancel=cancel, say=say)
    except live.LiveRefused as exc:
        tracker.finish("failed", "source", str(exc))
        raise
    except BaseException as exc:
        # the switchover began and the guest does not run here: it may run there
        there = cancel.committed and not live.runs_here(store, name)
        where = "unknown" if there else "source"
        ref = tracker.last.version or name
        cancelled = isinstance(exc, Cancelled) and not there
        head = (f"the live move of {name} was cancelled" if cancelled else
                f"the live move of {name} failed: {exc or type(exc).__name__}")
        tail = (f"it may run at {to_name or to} now (the switchover had begun): check there; its disks at T0 are "
                f"{ref}" if there else f"{name} runs on here" + (f"; its disks at T0 are {ref}" if "@" in ref else ""))
        tracker.finish("cancelled" if cancelled else "failed", where, f"{head}; {tail}")
        if not isinstance(exc, Exception):
            raise
        cls = MigrationCancelled if cancelled else MigrationFailed
        raise cls(f"{head}; {tail}", version=ref if "@" in ref else "", step="live", restored=not there,
                  reached=Reached(known=False, sent_bytes=tracker.wire_bytes), cause=exc) from exc
    seconds = time.monotonic() - t0
    last = tracker.finish("done", "destination", f"{name} runs at {to_name or to} after {seconds:.1f}s "
                          f"({moved.figures.pause_text()})")
    return MigrateResult("live", moved.sealed, moved.push, moved.remote, seconds, last, moved.figures)


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
               pushed: transfer.TransferReport | None, tally: Tracker, say: Callable[[str], None],
               steps: Steps, pin: str | None = None) -> MigrationFailed:
    ref = version.ref
    what = {"push": f"pushing {ref} to {to}", "start": f"starting {ref} at {to}",
            "run": f"starting {ref} at {to} (disks on demand from here)"}[step]
    cancelled = isinstance(exc, Cancelled)
    head = (f"migrating {version.capsule} was cancelled while {what}" if cancelled else
            f"migrating {version.capsule} failed while {what}: {exc or type(exc).__name__}")
    lines = [head, f"the guest's state was saved here as {ref}"]
    restored = False
    if _may_run_there(step, exc):
        lines.append(f"it was NOT started again here: {to} may have started it before the connection broke. "
                     f"Check there; if it does not run, `capsule start {ref}` here")
    else:  # first the guest, then the questions
        say(f"starting {ref} here again")
        try:
            steps.restore(store, ref, wait=False)
            restored = True
            lines.append(f"the guest runs here again from {ref}")
        except Error as again:
            lines.append(f"starting it again here failed too ({again}); `capsule start {ref}` retries")
    # an interrupt is re-raised as it is: do not keep the user waiting on the other host
    reached = steps.reached(store, version, to, token, pin) if isinstance(exc, Exception) else Reached(known=False)
    reached.sent_bytes = pushed.wire_bytes if pushed else tally.wire_bytes
    reached.recorded = reached.recorded or bool(pushed and pushed.recorded)
    lines.append(reached.describe(ref))
    cls = MigrationCancelled if cancelled else MigrationFailed
    return cls("; ".join(lines), version=ref, step=step, restored=restored, reached=reached, cause=exc)


def own_fingerprint(store: Store) -> str | None:
    """The fingerprint of this store's own host key (``capsule serve`` makes it), if it has one."""
    from capsule.agent.serve import host_fingerprint

    return host_fingerprint(store.home)


def _reached(store: Store, version: VersionRow, to: str, token: str, fingerprint: str | None = None) -> Reached:
    layers = list(dict.fromkeys(lid for chain in version.chains for lid in chain))
    files = [version.config["kernel"], version.config["initrd"], *([version.memory] if version.memory else [])]
    try:
        with AgentClient(to, token, timeout=30.0, fingerprint=fingerprint) as client:
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
