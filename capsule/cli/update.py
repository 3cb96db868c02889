"""CLI verbs for software updates: update make (and update apply)."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from capsule.cli import grammar
from capsule.cli.common import OPTIONS, console, emit, err_console, json_flag, open_store
from capsule.units import human as human_bytes
from capsule.update import apply as applying
from capsule.update import make as making

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON (the commands' output "
                                                      "still streams, to stderr).")]

app = typer.Typer(help="Software updates: make one inside a capsule, apply one to a user's capsule.",
                  no_args_is_help=True)


def _say(t0: float):  # noqa: ANN202
    def say(msg: str) -> None:
        err_console.print(f"[dim]{time.monotonic() - t0:6.1f}s[/] [cyan]»[/] {escape(msg)}")
    return say


def _output(chunk: str) -> None:
    stream = sys.stderr if OPTIONS.json else sys.stdout
    stream.write(chunk)
    stream.flush()


@app.command("make")
def make(
    base: Annotated[str, typer.Argument(help="BASE or BASE@V: the version to start from (BASE: its latest).")],
    name: Annotated[str | None, typer.Option("--name", help="The capsule that gets the result: a new name makes "
                                                            "a child capsule of BASE; BASE's own name (the "
                                                            "default) makes BASE's next version.")] = None,
    run: Annotated[list[str] | None, typer.Option("--run", help="A shell command to run as root in the guest "
                                                                "(repeatable; in order, after apt's steps).")] = None,
    install: Annotated[list[str] | None, typer.Option("--install", help="A Debian package to install "
                                                                        "(repeatable).")] = None,
    upgrade: Annotated[bool, typer.Option("--upgrade", help="apt-get upgrade.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds each command may run.")] =
        making.STEP_TIMEOUT,
    no_network: Annotated[bool, typer.Option("--no-network", help="No NIC in the guest (commands that need "
                                                                  "no download).")] = False,
    json: JsonOpt = False,
) -> None:
    """Boot BASE, run commands inside (output live), seal the result as a new version.

    The guest gets a NIC on QEMU's user-mode network (outbound only) for the run.

    apt's downloads and list files stay in RAM (tmpfs), then `apt-get clean`: none of it lands in the layer.

    Every file system is trimmed before the clean shutdown, so blocks freed inside cost nothing.

    A failing command (exit 17), a timeout or Ctrl-C records nothing.

    Examples:

      capsule update make web --install jq            # web's next version, with jq

      capsule update make web@3 --name web-tls --install nginx ssl-cert

      capsule update make web --upgrade

      capsule update make web --run 'systemctl enable app' --no-network

      capsule --json update make web --install tree   # output on stderr, summary JSON on stdout
    """
    json_flag(json)
    store = open_store()
    res = making.make(store, base, name=name, run=run, install=install, upgrade=upgrade,
                      network=not no_network, timeout=timeout, say=_say(time.monotonic()), output=_output)
    data = res.as_dict()

    def human() -> None:
        if res.version is None:
            console.print(f"[yellow]nothing changed[/] on {base}'s disks: no version made")
            return
        console.print(f"[bold green]{res.version.ref}[/] made from {res.base.ref} in {res.seconds:.0f}s")
        t = Table("layer", "file", "allocated", "data", "zero blocks")
        for layer in res.layers:
            t.add_row(layer["id"][:12], human_bytes(layer["file_bytes"]), human_bytes(layer["allocated_bytes"]),
                      human_bytes(layer["data_bytes"]), str(layer["zero_blocks"]))
        console.print(t)
        console.print(f"apt fetched {human_bytes(res.apt_debs_bytes)} of packages "
                      f"(and {human_bytes(res.apt_lists_bytes)} of lists), none of it kept; "
                      f"fstrim freed {human_bytes(res.trimmed_bytes)}; the ext4 journal's dead blocks left out: "
                      f"{human_bytes(res.journal_blocks_dropped * 4096)}")

    emit(data, human)


@app.command("apply")
def apply(
    name: Annotated[str, typer.Argument(help="The user's capsule (NAME): it gets a new version.")],
    system: Annotated[str, typer.Option("--system", help="NAME@V: the system version to move it to (made "
                                                         "from the system it runs on now).")],
    restart: Annotated[bool, typer.Option("--restart", help="If it runs (or is suspended): stop it cleanly "
                                                            "first and boot the new version after.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="With --restart: seconds the guest may take to shut "
                                                             "down before it is forced off.")] = 120.0,
    json: JsonOpt = False,
) -> None:
    """Move a capsule to a new system version; its data disks, memory size and CPUs stay as they are.

    Disk 0 (vda) is the system disk: the new version's is exactly the system version's.

    The other disks (--data-disk) are the user's and are kept as they are.

    What the guest wrote on its old system disk is not carried over (it stays in earlier versions).

    Refused, changing nothing, when the system version is not derived from the one the capsule runs on.

    Refused when the capsule runs or is suspended, unless --restart.

    Examples:

      capsule update apply alice --system web@4

      capsule update apply alice --system web@5 --restart
    """
    json_flag(json)
    store = open_store()
    res = applying.apply(store, name, system, restart=restart, stop_timeout=timeout, say=_say(time.monotonic()))

    def human() -> None:
        kept = len(res.version.chains) - 1
        console.print(f"[bold green]{res.version.ref}[/]: system {res.system.ref}, {kept} data disk(s) kept "
                      f"from {res.before.ref}" + (" — running" if res.restarted else ""))
        if res.dropped_layers:
            console.print(f"not carried over: {len(res.dropped_layers)} layer(s) the guest wrote on its old "
                          f"system disk (in {res.before.ref})")

    emit(res.as_dict(), human)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="update", help="Software updates: make (inside a capsule), apply (to a user's "
                                            "capsule).", rich_help_panel=grammar.IMAGES)
