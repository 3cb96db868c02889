"""CLI verbs for pods inside capsules: pod create, exec, ls, suspend, resume, kill, checkpoint, restore."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from capsule.cli.common import console, emit, json_flag, open_store, progress, short
from capsule.pod import ops
from capsule.units import human

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
RefArg = Annotated[str, typer.Argument(help="The pod as CAPSULE/POD.")]
CmdArg = Annotated[list[str], typer.Argument(help="The command, after `--`.")]

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
    to: Annotated[str, typer.Option("--to", help="Another running capsule of this host.")],
    json: JsonOpt = False,
) -> None:
    """Move a pod to another capsule of this host: checkpoint, then restore there. Refused up front if
    the name or the address is taken there (or, on the pod network, by a pod of another capsule); if
    the restore fails the pod runs again where it was. Between two capsules made with --pod-network the
    pod keeps its address and its peers' TCP connections go on:

      capsule pod migrate web1/srv --to web2
    """
    json_flag(json)
    with progress(f"moving {ref} to {to}") as say:
        r = ops.migrate(open_store(), ref, to, progress=say)
    emit(r, lambda: console.print(f"pod [bold]{r['pod']}[/] moved {r['from']} → {r['to']} at {r['ip']}: "
                                  f"checkpoint {r['checkpoint_seconds']:.2f}s, restore {r['restore_seconds']:.2f}s"))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="pod")
