"""Entry point: ``capsule [--home DIR] [--json] COMMAND …``."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

from capsule import __version__
from capsule.cli import (
    accounts,
    backup,
    capsules,
    fleet,
    grammar,
    hosts,
    images,
    migrate,
    pod,
    repo,
    runtime,
    transfer,
    update,
)
from capsule.cli.audited import audited_command
from capsule.cli.common import OPTIONS, report
from hashcache.transport import plain

app = typer.Typer(
    help="Capsule: name, version, run and move whole virtual computers.\n\n"
    "A capsule is a VM's disks, memory and device state as one object with versions "
    "(NAME@V). Start with `capsule doctor`, `capsule image build tiny tiny`, "
    "`capsule create demo --image tiny`, `capsule start demo`.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"capsule {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    home: Annotated[Path | None, typer.Option("--home", envvar="CAPSULE_HOME",
                                              help="Store directory (default: CAPSULE_HOME; else /var/lib/capsule "
                                                   "for root, ~/.local/share/capsule for others).")] = None,
    json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print Capsule's version and exit.")] = False,
    insecure_http: Annotated[bool, typer.Option(
        "--insecure-http", envvar=plain.ENV,
        help="Allow sending a token over plain http:// to another machine (refused otherwise: it would cross "
             "the network readable by anyone on the path). Only for hosts deliberately set up without TLS; "
             "loopback URLs never need it.")] = False,
) -> None:
    OPTIONS.home = home
    OPTIONS.json = json
    from capsule.privsep.drop import as_store_owner
    from capsule.store import default_home

    # root on a store another user owns (an agent's, `capsule serve --user`): the whole command runs as that user
    as_store_owner((home or default_home()).absolute())
    if insecure_http:
        plain.allow()   # this process and what it starts (disk servers, the watcher)


# each command names its --help panel (capsule/cli/grammar.py: PANELS)
capsules.register(app)
runtime.register(app)
transfer.register(app)
migrate.register(app)
hosts.register(app)
fleet.register(app)
backup.register(app)
repo.register(app)
pod.register(app)
app.add_typer(images.app, name="image", help="Build and list guest images.", rich_help_panel=grammar.IMAGES)
update.register(app)
accounts.register(app)
capsules.register_diagnostics(app)


def main() -> None:
    with audited_command(sys.argv[1:]) as outcome:     # a local change leaves its line in the store's audit log
        try:
            app()
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - the one place errors become exit codes
            outcome.failed(exc)
            if os.environ.get("CAPSULE_DEBUG") and not isinstance(exc, KeyboardInterrupt):
                traceback.print_exc()
            sys.exit(report(exc))


if __name__ == "__main__":
    main()
