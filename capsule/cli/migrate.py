"""``capsule migrate``: the library call (capsule.migrate) with its phases drawn live, and Ctrl-C as cancel
(the guest runs here again). A second Ctrl-C interrupts at once."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.table import Table
from rich.text import Text

from capsule.agentclient import read_token
from capsule.cli import grammar
from capsule.cli.common import (
    OPTIONS,
    PEER,
    FingerprintOpt,
    JsonOpt,
    TokenOpt,
    console,
    emit,
    err_console,
    json_flag,
    open_store,
    resolve_peer,
)
from capsule.cli.runtime import MethodOpt, PolicyOpt
from capsule.errors import Error
from capsule.migrate.progress import CancelToken, Snapshot
from capsule.units import human

LABELS = {"balloon": "balloon", "save": "save memory here", "memory": "memory image", "disk": "disks",
          "resume": "resume there"}
LIVE_LABELS = {"precheck": "pre-check", "disks": "disks at T0 (HCP)", "memory": "memory (guest runs)",
               "switchover": "switchover", "postcopy": "post-copy"}


def render(s: Snapshot) -> Table:
    """The phases as steps (done, current, to come), then the byte counters and the ETA."""
    t = Table.grid(padding=(0, 1))
    for i, p in enumerate(s.phases):
        if i < s.index or (i == s.index and s.outcome == "done"):
            mark = "[green]✓[/]"
        elif i == s.index:
            mark = "[red]✗[/]" if s.outcome else "[cyan]▶[/]"
        else:
            mark = "[dim]·[/]"
        detail = ""
        if i == s.index and s.phase_total:
            detail = f"{human(s.phase_done)} / {human(s.phase_total)}"
        live = "precheck" in s.phases
        if live and p == "memory" and s.round is not None:
            detail = (f"round {s.round}: {human(s.round_bytes)}, dirty "
                      f"{'?' if s.dirty_rate is None else s.dirty_rate} pages/s, "
                      f"{'?' if s.remaining_bytes is None else human(s.remaining_bytes)} left")
        if live and p == "switchover" and s.pause_ms is not None:
            detail = f"paused {s.pause_ms} ms"
        t.add_row(mark, (LIVE_LABELS if live else LABELS).get(p, p), detail)
    line = f"wire {human(s.wire_bytes)} · found locally {human(s.local_bytes)}"
    if s.total_bytes:
        line += f" · {human(s.done_bytes)} of {human(s.total_bytes)}"
    if s.eta_seconds is not None:
        line += f" · ETA {s.eta_seconds:.0f}s"
    t.add_row("", Text(line, style="dim"), "")
    if s.outcome is None and s.cancellable:
        t.add_row("", Text("Ctrl-C cancels (the capsule runs here again)", style="dim"), "")
    if s.message and "precheck" in s.phases:
        t.add_row("", Text(s.message, style="dim"), "")
    return t


@contextmanager
def ctrl_c_cancels(token: CancelToken) -> Iterator[None]:
    """While the migration runs, the first Ctrl-C asks it to stop; a second one interrupts."""
    asked = [False]

    def handler(signum: int, frame: Any) -> None:
        if asked[0]:
            raise KeyboardInterrupt
        asked[0] = True
        if token.cancel():
            err_console.print("[yellow]cancelling: the capsule will run here again (Ctrl-C again to interrupt)[/]")
        else:
            err_console.print("[yellow]too late to cancel: the other host is starting it[/]")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def migrate(
    name: Annotated[str, typer.Argument(help="A running capsule.")],
    to: Annotated[str, typer.Option("--to", help=f"The destination host: {PEER}.")],
    offline: Annotated[bool, typer.Option("--offline", help="Suspend here, then move it (the guest is paused for "
                                                            "the whole transfer); --mode full unless named.")]
    = False,
    check: Annotated[bool, typer.Option("--check", help="Only say why a live move would be refused (nothing "
                                                        "changes); exit status 0 when it may go.")] = False,
    max_pause: Annotated[float, typer.Option("--max-pause", metavar="SECONDS", help="Live: the longest the guest "
                                             "may pause at the switchover (0.01 to 60).")] = 1.0,
    postcopy: Annotated[bool, typer.Option("--postcopy", help="Live: allow post-copy, switched to when pre-copy "
                                                              "does not converge (the guest runs there while its "
                                                              "last pages follow). If the link breaks during "
                                                              "post-copy, the guest waits there and the post-copy "
                                                              "resumes when the link returns (--recover-timeout); "
                                                              "else the guest boots again here from its disks as "
                                                              "they were at the switchover. Off by default.")]
    = False,
    recover_timeout: Annotated[float, typer.Option("--recover-timeout", metavar="SECONDS", help="Post-copy: how "
                                                   "long to wait for a broken link to return (1 to 3600).")]
    = 120.0,
    mode: Annotated[str | None, typer.Option("--mode", help="An offline move (implies --offline): full: push, then "
                                                            "start there | demand: push the memory image, start "
                                                            "there, disk blocks paged in from here.")] = None,
    balloon: Annotated[bool, typer.Option("--balloon", help="Balloon before suspending (§4.1); implies "
                                                            "--offline.")] = False,
    balloon_policy: PolicyOpt = "cache",
    balloon_method: MethodOpt = "virtio",
    source_url: Annotated[str | None, typer.Option("--source-url", help="demand: this host's agent URL as the "
                                                                        "destination reaches it.")] = None,
    source_token_file: Annotated[Path | None, typer.Option(
        "--source-token-file", help="demand: the token the destination reads this host's disks with (default: "
                                    "STORE/agent.token, or once users exist a grant to read this capsule, which "
                                    "the destination ends when the run stops or is all local; at most 72 h).")]
    = None,
    prefetch: Annotated[bool, typer.Option("--prefetch", help="demand: pull the rest in the background.")] = False,
    fingerprint: FingerprintOpt = None,
    source_fingerprint: Annotated[str | None, typer.Option(
        "--source-fingerprint", help="demand: the certificate fingerprint the destination pins for this host's "
                                     "agent (default: this store's host key; give it when serving --cert).")]
    = None,
    token_file: TokenOpt = None, json: JsonOpt = False,
) -> None:
    """Move a running capsule to another host; it runs there after.

    Live by default: its disks are sealed at T0 and pushed (HCP: only blocks the other host lacks) while it
    runs, then libvirt sends its memory and the disks' writes since T0, all through the agents' tunnel; the
    guest pauses only at the switchover (at most --max-pause). --offline (or --mode, or --balloon, which imply
    it) suspends here, then pushes and starts (full, the default) or starts there at once with its disks paged
    in from here (demand). Shows each phase live; Ctrl-C cancels and the capsule runs here.

    Examples:

      capsule migrate alice --to home

      capsule migrate alice --to home --check

      capsule migrate alice --to https://home.example:7070 --token-file home.token --mode demand
    """
    json_flag(json)
    from capsule import migrate as lib
    from capsule.migrate.choice import choose

    kind = choose(False if offline else None, mode, balloon, postcopy,
                  names={"offline": "--offline", "mode": "--mode", "balloon": "--balloon", "postcopy": "--postcopy"})
    offline, mode = not kind.live, kind.mode
    store = open_store()
    if not offline:
        from capsule import bounds

        max_pause = float(bounds.check(lib.MAX_PAUSE, max_pause, "--max-pause"))
        recover_timeout = float(bounds.check(lib.RECOVER_TIMEOUT, recover_timeout, "--recover-timeout"))
    peer = resolve_peer(store, to, token_file, fingerprint)
    if check:
        _check(store, name, peer)
        return
    source_token = None
    if mode == "demand" and offline:
        if source_token_file is not None:
            source_token = read_token(source_token_file)
        else:   # the agent's token while it works, else a read grant for this capsule (capsule token ls: @host)
            from capsule.accounts import grants
            legacy = store.home / "agent.token"
            source_token = grants.for_demand_run(store, read_token(legacy) if legacy.exists() else None, name,
                                                 grants.local_issuer())
    cancel = CancelToken()
    events: list[Snapshot] = []
    quiet = OPTIONS.json or not err_console.is_terminal
    view = None if quiet else Live(console=err_console, refresh_per_second=8)
    with ctrl_c_cancels(cancel), view or nullcontext():
        def show(s: Snapshot) -> None:
            events.append(s)
            if view is not None:
                view.update(render(s))

        try:
            r = lib.migrate(store, name, peer.url, peer.token, mode=mode, balloon=balloon_policy if balloon else None,
                            balloon_method=balloon_method, source_url=source_url, source_token=source_token,
                            prefetch=prefetch, on_event=show, cancel=cancel, to_name=peer.label,
                            fingerprint=peer.fingerprint, source_fingerprint=source_fingerprint, live=not offline,
                            max_pause=max_pause, postcopy=postcopy, recover_timeout=recover_timeout)
        except Error as exc:
            if source_token is not None and source_token_file is None and getattr(exc, "restored", True):
                from capsule.accounts import grants
                grants.discard(store, source_token)
            raise
    data: dict[str, Any] = {"mode": r.mode, "version": r.suspended.version.ref if r.suspended.version else None,
            "push": r.push.as_dict() if r.push else None, "remote": r.remote, "seconds": round(r.seconds, 3),
            "progress": r.last.as_dict() if r.last else None}
    if r.live is not None:
        data["live"] = r.live.as_dict()
        data["events"] = [e.as_dict() for e in events]
        tail = r.live.switchover_text()
        emit(data, lambda: console.print(f"{name} now runs at {peer.label} (live) after {r.seconds:.2f}s, "
                                         f"{r.live.pause_text()}" + (f"; {tail}" if tail else "")))
        return
    emit(data, lambda: console.print(f"{name} now runs at {peer.label} ({r.mode}, {r.remote.get('mode')}) after "
                                     f"{r.seconds:.2f}s"))


def _check(store: Any, name: str, peer: Any) -> None:
    """``--check``: the pre-check's refusals (none: it may go); a refusal exits with a conflict's status."""
    from capsule.migrate import live, precheck

    refusals = precheck.precheck(store, name, precheck.Target(peer.url, peer.token, peer.fingerprint))

    def say() -> None:
        if not refusals:
            console.print(f"{name} may move live to {peer.label}")
        for r in refusals:
            console.print(f"[red]✗[/] {r.reason}: {r.detail}")

    emit({"capsule": name, "to": peer.label, "refusals": [r.as_dict() for r in refusals]}, say)
    if refusals:
        raise typer.Exit(live.LiveRefused.exit_code)


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel=grammar.MOVING)(migrate)
