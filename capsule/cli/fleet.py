"""CLI verbs for a fleet of hosts: fleet add, ls, rm, status, push, rollback."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live
from rich.table import Table

from capsule import transfer
from capsule.agentclient import read_token
from capsule.cli import grammar
from capsule.cli.common import (
    OPTIONS,
    PEER,
    JsonOpt,
    console,
    emit,
    err_console,
    json_flag,
    known_host_name,
    open_store,
    resolve_peer,
)
from capsule.errors import InvalidInput, NotFound
from capsule.fleet import members
from capsule.fleet import push as pushing
from capsule.fleet.plan import parse_waves
from capsule.fleet.rollout import HostResult
from capsule.fleet.status import status as fleet_status
from capsule.names import parse_ref
from capsule.store import Store
from capsule.units import human as human_bytes

GroupOpt = Annotated[str | None, typer.Option("--group", "-g", help="Only the hosts of this group.")]

app = typer.Typer(help="Hosts kept on one software configuration: add them, see what they run, roll out "
                       "versions (canaries, waves, fan-out) and roll back.", no_args_is_help=True)
MEMBERS = "Members"
ROLLOUTS = "Rollouts"

_STYLE = {"waiting": "dim", "offline": "yellow", "sending": "cyan", "activating": "cyan", "done": "green",
          "already": "green", "failed": "red", "not started": "dim", "held back": "dim"}


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "never"


@app.command(rich_help_panel=MEMBERS)
def add(
    host: Annotated[str, typer.Argument(help="A short name for the host; or, without URL, a known host: its name "
                                             "or its agent URL (`capsule host ls`).")],
    url: Annotated[str | None, typer.Argument(help="A new host's agent: https://HOST:PORT (see `capsule serve`); "
                                                   "it becomes a known host too.")] = None,
    token_file: Annotated[Path | None, typer.Option("--token-file", help="With URL: the file holding that agent's "
                                                                         "token (default: CAPSULE_TOKEN).")] = None,
    group: Annotated[str, typer.Option("--group", "-g", help="The host's group.")] = members.DEFAULT_GROUP,
    fingerprint: Annotated[str | None, typer.Option(
        "--fingerprint", help="A new host's certificate fingerprint (SHA256:…, printed by `capsule serve` "
                              "there), pinned; or add it first with `capsule host add`, which shows it.")] = None,
    json: JsonOpt = False,
) -> None:
    """Put a host in the fleet: a known host (`capsule host add`), or a new one with its URL (it becomes a known
    host too).

    Examples:

      capsule fleet add home --group canary

      capsule fleet add edge1 https://edge1.example:7070 --token-file edge.token --fingerprint SHA256:…
    """
    json_flag(json)
    store = open_store()
    if url is None:
        if token_file is not None or fingerprint is not None:
            raise InvalidInput("--token-file and --fingerprint are for a new host: give its URL too "
                               "(a known host's come from `capsule host add`)")
        try:
            peer = resolve_peer(store, known_host_name(store, host))
        except NotFound as exc:
            raise NotFound(f"{exc}; a new host is added with its URL: `capsule fleet add NAME https://HOST:PORT "
                           "--token-file FILE`") from exc
        m = members.add(store, peer.label, peer.url, peer.token, group)
    else:
        m = members.add(store, host, url, read_token(token_file), group, fingerprint=fingerprint)
    emit(m.as_dict(), lambda: console.print(f"added [bold]{m.name}[/] ({m.peer.url}) to group {m.group}"))


@app.command("ls", rich_help_panel=MEMBERS)
def ls(group: GroupOpt = None, json: JsonOpt = False) -> None:
    """List the fleet's hosts and groups (no network)."""
    json_flag(json)
    store = open_store()
    rows = [m.as_dict() for m in members.members(store, group)]

    def human() -> None:
        if not rows:
            console.print("no hosts in the fleet: `capsule fleet add HOST https://HOST:PORT --token-file F`")
            return
        t = Table("host", "group", "url", "last answered")
        for r in rows:
            t.add_row(r["host"], r["group"], r["url"], _when(r["last_seen"]))
        console.print(t)

    emit(rows, human)


@app.command("rm", rich_help_panel=MEMBERS)
def rm(host: Annotated[str, typer.Argument(help="The host to take out of the fleet: its name or its agent URL.")],
       json: JsonOpt = False) -> None:
    """Take a host out of the fleet (it stays a known peer; nothing on it changes)."""
    json_flag(json)
    store = open_store()
    m = members.remove(store, known_host_name(store, host))
    emit({"removed": m.name}, lambda: console.print(f"took [bold]{m.name}[/] out of the fleet"))


@app.command(rich_help_panel=MEMBERS)
def status(
    group: GroupOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for all hosts together.")] = 5.0,
    json: JsonOpt = False,
) -> None:
    """Which host holds and runs which version of each fleet capsule (all hosts asked at once)."""
    json_flag(json)
    data = fleet_status(open_store(), group, timeout)

    def human() -> None:
        names = list(data["capsules"])
        t = Table("host", "group", *[f"{n} (fleet @{data['capsules'][n]})" for n in names], "last answered")
        for row in data["hosts"]:
            cells = []
            for n in names:
                c = row["capsules"][n]
                if c["holds"] is None:
                    cells.append("[yellow]?[/]")
                    continue
                held = ",".join(f"@{v}" for v in c["holds"]) or "-"
                run = f" [bold]runs @{c['running']}[/]" if c["running"] else ""
                cells.append(f"[{'green' if c['current'] else 'red'}]{held}[/]{run}")
            last = _when(row["last_seen"])
            seen = last if row["reachable"] else f"[red]no answer[/] (last {last})"
            t.add_row(row["host"], row["group"], *cells, seen)
        console.print(t)

    emit(data, human)


class _Board:
    """The live per-host table of a rollout."""

    def __init__(self) -> None:
        self.rows: dict[str, HostResult] = {}
        self.lock = threading.Lock()

    def update(self, r: HostResult) -> None:
        with self.lock:
            self.rows[r.host] = r

    def table(self) -> Table:
        t = Table("host", "stage", "state", "from", "bytes", "detail")
        with self.lock:
            for r in self.rows.values():
                style = _STYLE.get(r.state, "")
                t.add_row(r.host, r.stage, f"[{style}]{r.state}[/]", r.source or "-",
                          human_bytes(r.bytes) if r.bytes else "-", r.reason or r.activation or "")
        return t


def _run(action, title: str) -> pushing.PushReport:  # noqa: ANN001
    board = _Board()
    if OPTIONS.json or not err_console.is_terminal:
        report = action(board.update)
    else:
        with Live(board.table(), console=err_console, refresh_per_second=4, transient=True) as live:
            def on_event(r: HostResult) -> None:
                board.update(r)
                live.update(board.table())
            report = action(on_event)
    for r in report.outcome.results:
        board.update(r)

    def human() -> None:
        if report.via is not None:
            console.print(f"via {report.via['url']}: this host uploaded {human_bytes(report.via['origin_sent_bytes'])}"
                          " to it and sent nothing to any host")
        console.print(f"[bold]{title} {report.ref}[/]: " + " → ".join(
            f"{s.name} [{len(s.hosts)}]" for s in report.plan.stages))
        console.print(board.table())
        if report.plan.held_back:
            console.print(f"held back (beyond the last wave): {', '.join(report.plan.held_back)}")
        offline = [r.host for r in report.outcome.results if r.state == "offline"]
        if offline:
            console.print(f"[yellow]offline[/]: {', '.join(offline)} — the next run sends them the version")
        if report.outcome.stopped:
            console.print(f"[red]{report.outcome.stopped}[/]")
        else:
            console.print(f"[green]rollout complete[/] in {report.seconds:.1f}s")

    emit(report.as_dict(), human)
    if report.outcome.stopped:
        raise typer.Exit(16)
    return report


def _hosts(store: Store, to: list[str] | None, host: list[str] | None) -> list[str] | None:
    """The fleet hosts --to names (names or URLs), with those of the old spelling --host."""
    if host:
        grammar.deprecated("--host", "--to PEER")
    named = [*(to or []), *(host or [])]
    return [known_host_name(store, h) for h in named] or None


def _options(group: str | None, hosts: list[str] | None, canary: int, waves: str, max_failures: int,
             parallel: int, no_fanout: bool, activate: bool) -> pushing.PushOptions:
    return pushing.PushOptions(group=group, hosts=hosts, canary=canary, waves=parse_waves(waves),
                               max_failures=max_failures, parallel=parallel, fanout=not no_fanout,
                               activate=activate)


def _via(opts: pushing.PushOptions, via: str | None, key_file: Path | None) -> None:
    """--via and --key-file into the options: the URL checked before the passphrase is asked."""
    if via is None:
        if key_file is not None:
            raise InvalidInput("--key-file opens the repository of --via: give --via s3://HOST:PORT/BUCKET/PREFIX too")
        return
    from capsule.repo import crypto
    from capsule.repo.s3 import parse_url

    parse_url(via)
    opts.via, opts.via_secret = via, crypto.read_secret(key_file)


ToOpt = Annotated[list[str] | None, typer.Option("--to", help=f"Only this fleet host (repeatable): {PEER}.")]
OldHostOpt = Annotated[list[str] | None, typer.Option("--host", hidden=True, help="The old spelling of --to.")]
CanaryOpt = Annotated[int, typer.Option("--canary", help="Hosts that get it first, alone.")]
WavesOpt = Annotated[str, typer.Option("--waves", help="Cumulative shares of the hosts, one wave each.")]
MaxFailOpt = Annotated[int, typer.Option("--max-failures", help="Failed hosts tolerated; one more stops it.")]
ParallelOpt = Annotated[int, typer.Option("--parallel", help="Transfers each sender runs at a time.")]
NoFanoutOpt = Annotated[bool, typer.Option("--no-fanout", help="Only this host sends (no host passes it on).")]
ViaOpt = Annotated[str | None, typer.Option(
    "--via", help="Go through this repository (s3://HOST:PORT/BUCKET/PREFIX, or s3+http://… without TLS; "
                  "made with `capsule repo init`): this host uploads the version to it once (only the blocks "
                  "it lacks), and every host that gets it from no peer restores it from there, --parallel at "
                  "a time, so this host's uplink no longer bounds the rollout. Its key opens with "
                  "CAPSULE_REPO_PASSPHRASE, a prompt, or --key-file; S3 credentials as `capsule repo` reads "
                  "them (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws/credentials). Each host is handed "
                  "the opened key and the credentials for its one restore, over its agent's authenticated "
                  "channel, and keeps them only in memory.")]
KeyFileOpt = Annotated[Path | None, typer.Option(
    "--key-file", help="With --via: open the repository with this key file's bytes instead of a "
                       "passphrase.")]


@app.command(rich_help_panel=ROLLOUTS)
def push(
    ref: Annotated[str, typer.Argument(help="NAME@V: the version to roll out.")],
    group: GroupOpt = None, to: ToOpt = None, canary: CanaryOpt = 0, waves: WavesOpt = "100%",
    max_failures: MaxFailOpt = 0, parallel: ParallelOpt = 4, no_fanout: NoFanoutOpt = False,
    activate: Annotated[bool, typer.Option("--activate", help="Where another version of it runs, stop that "
                                                              "and start this one.")] = False,
    zstd_level: Annotated[int | None, typer.Option(
        "--zstd-level", min=1, max=19,
        help="zstd level of the blocks on the wire, from this host and between hosts (fan-out), overriding "
             "the automatic choice (by default each transfer measures its link and picks the codec and level "
             "that keep it full with the fewest bytes). Higher sends fewer bytes for more CPU at each sender. "
             "From 10 an object's blocks travel from this host as one zstd stream, so later batches match "
             "earlier ones: on new layers of Debian packages 19 sent 15-31 % less than 3 and took ~25 times "
             "as long to compress.")] = None,
    xz: Annotated[bool, typer.Option(
        "--xz", help="From this host, send each object's new blocks as one xz (LZMA2, xz -6) stream, overriding "
                     "the automatic choice: the fewest bytes (new packages: 5-9 % fewer than --zstd-level 19, "
                     "about as slow to compress). Between hosts (fan-out) blocks go at --zstd-level, or at "
                     "levels picked by the link.")] = False,
    via: ViaOpt = None, key_file: KeyFileOpt = None,
    json: JsonOpt = False, host: OldHostOpt = None,
) -> None:
    """Roll a version out: canaries, then waves; hosts that have it pass it on (fan-out).

    With --via REPO the repository stands in for this host as the source of last resort: this host sends the
    version to the repository only, the hosts restore it from there or pull it from a peer that has it; the
    report says, per host, where it came from ("repository" or a peer) and what this host uploaded.

    Examples:

      capsule fleet push web@4 --canary 1 --waves 50%,100%

      capsule fleet push web@4 --to edge1 --to edge2 --activate

      capsule fleet push web@4 --via s3://store.example:8333/fleet/web --parallel 8
    """
    json_flag(json)
    store = open_store()
    opts = _options(group, _hosts(store, to, host), canary, waves, max_failures, parallel, no_fanout, activate)
    _via(opts, via, key_file)
    topts = transfer.Options(level=zstd_level, xz=xz)
    _run(lambda on_event: pushing.push(store, ref, opts, on_event, transfer_opts=topts), "push")


@app.command(rich_help_panel=ROLLOUTS)
def rollback(
    ref: Annotated[str, typer.Argument(help="NAME@V: the fleet capsule's version to put back.")],
    group: GroupOpt = None, to: ToOpt = None, canary: CanaryOpt = 0, waves: WavesOpt = "100%",
    max_failures: MaxFailOpt = 0, parallel: ParallelOpt = 4, no_fanout: NoFanoutOpt = False,
    via: ViaOpt = None, key_file: KeyFileOpt = None, json: JsonOpt = False, host: OldHostOpt = None,
) -> None:
    """Put an earlier version back: sent where missing, started where another version of it runs.

    Examples:

      capsule fleet rollback web@3

      capsule fleet rollback web@3 --via s3://store.example:8333/fleet/web
    """
    json_flag(json)
    versions = [t for t in to or [] if t.startswith("@")]
    if versions:                        # the old spelling: fleet rollback NAME --to @V
        grammar.deprecated("`capsule fleet rollback NAME --to @V`", "`capsule fleet rollback NAME@V`")
        if len(versions) > 1 or "@" in ref:
            raise InvalidInput(f"give the version once, as NAME@V (not {ref!r} and --to {' '.join(versions)})")
        ref += versions[0]
        to = [t for t in to or [] if not t.startswith("@")]
    version = parse_ref(ref)
    if version.version is None:
        raise InvalidInput(f"give the version to put back as NAME@V, e.g. {version.name}@3 (not {ref!r})")
    store = open_store()
    opts = _options(group, _hosts(store, to, host), canary, waves, max_failures, parallel, no_fanout, True)
    _via(opts, via, key_file)
    _run(lambda on_event: pushing.rollback(store, version.name, f"@{version.version}", opts, on_event), "rollback")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="fleet", help="A fleet of hosts on one software configuration: add, ls, rm, "
                                           "status, push, rollback.", rich_help_panel=grammar.HOSTS)
