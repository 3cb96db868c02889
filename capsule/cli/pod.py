"""CLI verbs for pods inside capsules: pod create, exec, ls, suspend, resume, kill, checkpoint, restore."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from capsule.cli.common import FingerprintOpt, console, emit, json_flag, open_store, peer_destination, progress, short
from capsule.pod import group, ops, remote
from capsule.pod.errors import PodNameInvalid
from capsule.units import human

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
RefArg = Annotated[str, typer.Argument(help="The pod as CAPSULE/POD.")]
CmdArg = Annotated[list[str], typer.Argument(help="The command, after `--`.")]
TokenOpt = Annotated[Path | None, typer.Option("--token-file", help="With --host URL: the file holding that agent's "
                                                                    "token (default: CAPSULE_TOKEN).")]

app = typer.Typer(help="Pods: groups of processes inside a running capsule with their own PIDs, mounts "
                       "(private /tmp), host name, IPC, cgroup and IP address (Zap); checkpointed with CRIU "
                       "into a pod image in the store and restarted in the same or another capsule.",
                  no_args_is_help=True)


@app.command()
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


@app.command("exec")
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


@app.command("ls")
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


def _simple(verb: str, doc: str) -> None:
    def command(ref: RefArg, json: JsonOpt = False) -> None:
        json_flag(json)
        r = getattr(ops, verb)(open_store(), ref)
        emit(r, lambda: console.print(f"pod [bold]{ref}[/]: {r.get('state', verb)}"))

    command.__doc__ = doc
    app.command(verb)(command)


_simple("suspend", "Freeze every process of the pod (cgroup v2 freezer).")
_simple("resume", "Thaw a suspended pod.")
_simple("kill", "Kill every process of the pod and remove it (its address is free again).")


@app.command()
def checkpoint(
    ref: RefArg,
    leave_running: Annotated[bool, typer.Option("--leave-running", help="Keep the pod running after.")] = False,
    json: JsonOpt = False,
) -> None:
    """Dump the pod with CRIU into a pod image sealed in this host's store. Without --leave-running the
    pod stops once the image is safe here (it keeps running if anything fails)."""
    json_flag(json)
    with progress(f"checkpointing {ref}") as say:
        r = ops.checkpoint(open_store(), ref, leave_running=leave_running, progress=say)
    emit(r.as_dict(), lambda: console.print(
        f"pod image [bold]{short(r.image)}[/] ({human(r.size)}): dump {r.dump_seconds:.2f}s, copy "
        f"{r.copy_seconds:.2f}s, {r.seconds:.2f}s in all; pod {'still running' if r.left_running else 'stopped'}"))


@app.command()
def restore(
    image: Annotated[str, typer.Argument(help="The pod image's id (or a unique prefix, ≥ 6 digits).")],
    into: Annotated[str, typer.Option("--into", help="The running capsule to restart it in.")],
    json: JsonOpt = False,
) -> None:
    """Restart a pod from its image, with its PIDs, files in /tmp, host name and address."""
    json_flag(json)
    with progress(f"restoring {short(image)} into {into}") as say:
        r = ops.restore(open_store(), image, into, progress=say)
    emit(r, lambda: console.print(f"pod [bold]{into}/{r['name']}[/] runs again at {r['ip']} "
                                  f"({r['seconds']:.2f}s)"))


@app.command()
def migrate(
    ref: RefArg,
    to: Annotated[str, typer.Option("--to", help="The running capsule to move it into (on this host, or on "
                                                 "--host).")],
    host: Annotated[str | None, typer.Option(
        "--host", help="The capsule is on another host: a known host's name (`capsule host ls`) or its agent "
                       "URL (with --token-file).")] = None,
    token_file: TokenOpt = None,
    fingerprint: FingerprintOpt = None,
    json: JsonOpt = False,
) -> None:
    """Move a pod to another capsule, on this host or another: checkpoint (the pod stops, its TCP peers
    wait), then restore there with its PIDs, files and address. With --host the image travels with HCP
    and the other host's agent restores it. Refused up front if the name or the address is taken there;
    if sending or restoring fails the pod runs again where it was. Between two capsules of this host made
    with --pod-network (the address free on the whole pod network) the pod keeps its address and its
    peers' TCP connections go on:

      capsule pod migrate web1/srv --to web2
    """
    json_flag(json)
    store = open_store()
    with progress(f"moving {ref} to {to}{f' on {host}' if host else ''}") as say:
        if host is None:
            r = ops.migrate(store, ref, to, progress=say)
        else:
            url, token, label = peer_destination(store, host, token_file)
            r = remote.migrate(store, ref, to, url, token, fingerprint=fingerprint, progress=say)
            r["host"] = label
    where = f"{r['to']} on {r['host']}" if host else r["to"]
    sent = f", {human(r['wire_bytes'])} on the wire" if host else ""
    emit(r, lambda: console.print(f"pod [bold]{r['pod']}[/] moved {r['from']} → {where} at {r['ip']}: "
                                  f"checkpoint {r['checkpoint_seconds']:.2f}s, restore "
                                  f"{r['restore_seconds']:.2f}s{sent}"))


@app.command("checkpoint-group")
def checkpoint_group(
    refs: Annotated[list[str], typer.Argument(help="The pods, as CAPSULE/POD, two or more (capsules of this host).")],
    json: JsonOpt = False,
) -> None:
    """Checkpoint pods that talk to each other as one consistent group (ZapC): every member's network is
    locked first, then all are dumped at once (their TCP connections with them), and one group image is
    recorded. The pods stop; `pod restore-group` restarts them together and their conversations go on."""
    json_flag(json)
    with progress(f"checkpointing {len(refs)} pods as a group"):
        r = group.checkpoint_group(open_store(), refs)
    emit(r, lambda: console.print(f"group image [bold]{short(r['group'])}[/]: {len(r['members'])} pods, "
                                  f"locked in {r['lock_seconds']:.2f}s, {r['seconds']:.2f}s in all"))


@app.command("restore-group")
def restore_group(
    image: Annotated[str, typer.Argument(help="The group image's id (or a unique prefix, ≥ 6 digits).")],
    into: Annotated[list[str] | None, typer.Option(
        "--into", help="POD=CAPSULE: restart that member in another running capsule (repeatable); the "
                       "others go back to their own capsules.")] = None,
    json: JsonOpt = False,
) -> None:
    """Restart every pod of a group image at once, each in its capsule or where --into says; all or none."""
    json_flag(json)
    moves: dict[str, str] = {}
    for item in into or []:
        pod, sep, capsule = item.partition("=")
        if not sep or not pod or not capsule:
            raise PodNameInvalid(f"--into {item!r}: give POD=CAPSULE")
        moves[pod] = capsule
    with progress(f"restoring group {short(image)}"):
        r = group.restore_group(open_store(), image, moves)
    emit(r, lambda: console.print("\n".join(f"pod [bold]{m['capsule']}/{m['pod']}[/] runs again at {m['ip']}"
                                            for m in r["members"]) + f"\n({r['seconds']:.2f}s)"))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="pod")
