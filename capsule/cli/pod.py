"""CLI verbs for pods inside capsules: pod create, exec, ls, freeze, thaw, kill, checkpoint, restore, migrate,
checkpoint-group, restore-group (and the old spellings suspend, resume, --into, --host)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from capsule.cli import grammar
from capsule.cli.common import (
    PEER,
    FingerprintOpt,
    JsonOpt,
    TokenOpt,
    console,
    emit,
    json_flag,
    open_store,
    progress,
    resolve_peer,
    short,
)
from capsule.errors import InvalidInput
from capsule.pod import group, ops, remote
from capsule.pod.errors import PodNameInvalid
from capsule.units import human

RefArg = Annotated[str, typer.Argument(help="The pod as CAPSULE/POD.")]
CmdArg = Annotated[list[str], typer.Argument(help="The command, after `--`.")]
OldInto = Annotated[str | None, typer.Option("--into", hidden=True, help="The old spelling of --to.")]

app = typer.Typer(help="Pods: groups of processes inside a running capsule, checkpointed and moved.\n\n"
                       "Each has its own PIDs, mounts (private /tmp), host name, IPC, cgroup and IP address (Zap); "
                       "it is checkpointed with CRIU into a pod image in the store and restarted in the same or "
                       "another capsule.",
                  no_args_is_help=True)
RUNNING = "Running pods"
SAVED = "Checkpoints"
MOVING = "Moving between capsules"


@app.command(rich_help_panel=RUNNING)
def create(
    capsule: Annotated[str, typer.Argument(help="A running capsule of this host (Debian image).")],
    pod: Annotated[str, typer.Argument(help="The pod's name: a-z, 0-9, '-', at most 31.")],
    cmd: CmdArg,
    ip: Annotated[str | None, typer.Option("--ip", help="The pod's address A.B.C.D/N on the capsule's pod "
                                                        "bridge (default: the next free one of 198.18.0.0/24).")]
    = None,
    json: JsonOpt = False,
) -> None:
    """Start a pod running CMD (the pod's init is its PID 1 and reaps its processes)."""
    json_flag(json)
    r = ops.create(open_store(), capsule, pod, cmd, ip)
    emit(r, lambda: console.print(f"pod [bold]{capsule}/{pod}[/] runs at {r['ip']}"))


@app.command("exec", rich_help_panel=RUNNING)
def exec_(
    ref: RefArg,
    cmd: CmdArg,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds the command may take.")] = 30.0,
    json: JsonOpt = False,
) -> None:
    """Run a command inside the pod (its namespaces and cgroup); it stays in the pod if it forks."""
    json_flag(json)
    r = ops.exec_in(open_store(), ref, cmd, timeout)

    def show() -> None:
        typer.echo(r["stdout"], nl=False)
        typer.echo(r["stderr"], nl=False, err=True)

    emit(r, show)
    if r["exit_code"]:
        raise typer.Exit(r["exit_code"] if 0 < r["exit_code"] < 256 else 1)


@app.command("ls", rich_help_panel=RUNNING)
def ls(
    capsule: Annotated[str | None, typer.Argument(help="One capsule (default: every running one).")] = None,
    json: JsonOpt = False,
) -> None:
    """The pods of running capsules: address, state, processes."""
    json_flag(json)
    pods = ops.ls(open_store(), capsule)

    def show() -> None:
        t = Table("pod", "ip", "state", "processes", "init pid (capsule)")
        for p in pods:
            t.add_row(f"{p['capsule']}/{p['name']}", p["ip"], p["state"], str(p["processes"]), str(p["init_pid"]))
        console.print(t)

    emit(pods, show)


def _kill(ref: RefArg, json: JsonOpt = False) -> None:
    """Kill every process of the pod and remove it (its address is free again)."""
    json_flag(json)
    r = ops.kill(open_store(), ref)
    emit(r, lambda: console.print(f"pod [bold]{ref}[/]: {r.get('state', 'killed')}"))


def _freeze(ref: RefArg, json: JsonOpt = False) -> None:
    """Freeze every process of the pod in place; `pod thaw` lets them run again.

    The cgroup v2 freezer: nothing is saved, the pod keeps its memory in the capsule (a capsule, by contrast,
    is suspended: saved and stopped)."""
    json_flag(json)
    r = ops.suspend(open_store(), ref)
    emit(r, lambda: console.print(f"pod [bold]{ref}[/]: frozen"))


def _thaw(ref: RefArg, json: JsonOpt = False) -> None:
    """Let the processes of a frozen pod run again."""
    json_flag(json)
    r = ops.resume(open_store(), ref)
    emit(r, lambda: console.print(f"pod [bold]{ref}[/]: running"))


app.command("freeze", rich_help_panel=RUNNING)(_freeze)
app.command("thaw", rich_help_panel=RUNNING)(_thaw)
app.command("kill", rich_help_panel=RUNNING)(_kill)
grammar.alias(app, "pod suspend", "pod freeze", _freeze)
grammar.alias(app, "pod resume", "pod thaw", _thaw)


@app.command(rich_help_panel=SAVED)
def checkpoint(
    ref: RefArg,
    leave_running: Annotated[bool, typer.Option("--leave-running", help="Keep the pod running after.")] = False,
    json: JsonOpt = False,
) -> None:
    """Dump the pod with CRIU into a pod image sealed in this host's store.

    Without --leave-running the pod stops once the image is safe here (it keeps running if anything fails)."""
    json_flag(json)
    with progress(f"checkpointing {ref}") as say:
        r = ops.checkpoint(open_store(), ref, leave_running=leave_running, progress=say)
    emit(r.as_dict(), lambda: console.print(
        f"pod image [bold]{short(r.image)}[/] ({human(r.size)}): dump {r.dump_seconds:.2f}s, copy "
        f"{r.copy_seconds:.2f}s, {r.seconds:.2f}s in all; pod {'still running' if r.left_running else 'stopped'}"))


@app.command(rich_help_panel=SAVED)
def restore(
    image: Annotated[str, typer.Argument(help="The pod image's id (or a unique prefix, ≥ 6 digits).")],
    to: Annotated[str | None, typer.Option("--to", help="The running capsule of this host to restart it in.")]
    = None,
    json: JsonOpt = False, into: OldInto = None,
) -> None:
    """Restart a pod from its image, with its PIDs, files in /tmp, host name and address.

    Example:

      capsule pod restore 3f2a9c01 --to bob
    """
    json_flag(json)
    to = grammar.renamed("--into", into, "--to", to)
    if to is None:
        raise InvalidInput("give the running capsule to restart the pod in: --to CAPSULE")
    with progress(f"restoring {short(image)} into {to}") as say:
        r = ops.restore(open_store(), image, to, progress=say)
    emit(r, lambda: console.print(f"pod [bold]{to}/{r['name']}[/] runs again at {r['ip']} "
                                  f"({r['seconds']:.2f}s)"))


@app.command(rich_help_panel=MOVING)
def migrate(
    ref: RefArg,
    to: Annotated[str, typer.Option("--to", help="The running capsule to move it into (on this host, or on the "
                                                 "host --on names).")],
    on: Annotated[str | None, typer.Option("--on", help=f"The host the --to capsule is on: {PEER}. Default: this "
                                                        "host.")] = None,
    token_file: TokenOpt = None,
    fingerprint: FingerprintOpt = None,
    json: JsonOpt = False,
    host: Annotated[str | None, typer.Option("--host", hidden=True, help="The old spelling of --on.")] = None,
) -> None:
    """Move a pod to another capsule, on this host or another (--on).

    Checkpoint (the pod stops, its TCP peers wait), then restore there with its PIDs, files and address.
    With --on the image travels with HCP and the other host's agent restores it. Refused up front if the
    name or the address is taken there; if sending or restoring fails the pod runs again where it was.
    Between two capsules of this host made with --pod-network (the address free on the whole pod network)
    the pod keeps its address and its peers' TCP connections go on.

    Examples:

      capsule pod migrate web1/srv --to web2

      capsule pod migrate web1/srv --to carol --on home
    """
    json_flag(json)
    on = grammar.renamed("--host", host, "--on", on)
    store = open_store()
    peer = resolve_peer(store, on, token_file, fingerprint) if on is not None else None
    if peer is None and (token_file is not None or fingerprint is not None):
        raise InvalidInput("--token-file and --fingerprint are for the other host: give --on PEER too")
    with progress(f"moving {ref} to {to}{f' on {peer.label}' if peer else ''}") as say:
        if peer is None:
            r = ops.migrate(store, ref, to, progress=say)
        else:
            r = remote.migrate(store, ref, to, peer.url, peer.token, fingerprint=peer.fingerprint, progress=say)
            r["host"] = peer.label
    where = f"{r['to']} on {r['host']}" if peer else r["to"]
    sent = f", {human(r['wire_bytes'])} on the wire" if peer else ""
    emit(r, lambda: console.print(f"pod [bold]{r['pod']}[/] moved {r['from']} → {where} at {r['ip']}: "
                                  f"checkpoint {r['checkpoint_seconds']:.2f}s, restore "
                                  f"{r['restore_seconds']:.2f}s{sent}"))


@app.command("checkpoint-group", rich_help_panel=SAVED)
def checkpoint_group(
    refs: Annotated[list[str], typer.Argument(help="The pods, as CAPSULE/POD, two or more (capsules of this host).")],
    json: JsonOpt = False,
) -> None:
    """Checkpoint pods that talk to each other as one consistent group (ZapC).

    Every member's network is locked first, then all are dumped at once (their TCP connections with them),
    and one group image is recorded. The pods stop; `pod restore-group` restarts them together and their
    conversations go on."""
    json_flag(json)
    with progress(f"checkpointing {len(refs)} pods as a group"):
        r = group.checkpoint_group(open_store(), refs)
    emit(r, lambda: console.print(f"group image [bold]{short(r['group'])}[/]: {len(r['members'])} pods, "
                                  f"locked in {r['lock_seconds']:.2f}s, {r['seconds']:.2f}s in all"))


@app.command("restore-group", rich_help_panel=SAVED)
def restore_group(
    image: Annotated[str, typer.Argument(help="The group image's id (or a unique prefix, ≥ 6 digits).")],
    to: Annotated[list[str] | None, typer.Option(
        "--to", help="POD=CAPSULE: restart that member in another running capsule (repeatable); the "
                     "others go back to their own capsules.")] = None,
    json: JsonOpt = False,
    into: Annotated[list[str] | None, typer.Option("--into", hidden=True, help="The old spelling of --to.")]
    = None,
) -> None:
    """Restart every pod of a group image at once, each in its capsule or where --to says; all or none.

    Example:

      capsule pod restore-group 5e1fa0 --to app=web3
    """
    json_flag(json)
    if into:
        grammar.deprecated("--into", "--to POD=CAPSULE")
    moves: dict[str, str] = {}
    for item in [*(to or []), *(into or [])]:
        pod, sep, capsule = item.partition("=")
        if not sep or not pod or not capsule:
            raise PodNameInvalid(f"--to {item!r}: give POD=CAPSULE")
        moves[pod] = capsule
    with progress(f"restoring group {short(image)}"):
        r = group.restore_group(open_store(), image, moves)
    emit(r, lambda: console.print("\n".join(f"pod [bold]{m['capsule']}/{m['pod']}[/] runs again at {m['ip']}"
                                            for m in r["members"]) + f"\n({r['seconds']:.2f}s)"))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="pod", rich_help_panel=grammar.PODS)
