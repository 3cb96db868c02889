"""Shared CLI plumbing: the store option, --json output, progress, errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from capsule.store import Store
from hashcache.errors import Error, Internal

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


@dataclass
class Options:
    home: Path | None = None
    json: bool = False


OPTIONS = Options()


def open_store() -> Store:
    return Store.open(OPTIONS.home)


def emit(data: Any, human: Callable[[], None]) -> None:
    """Print ``data`` as JSON under --json, else call ``human``."""
    if OPTIONS.json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        human()


@contextmanager
def progress(title: str) -> Iterator[Callable[[str], None]]:
    """A spinner with a changing status line; silent under --json."""
    if OPTIONS.json or not err_console.is_terminal:
        yield lambda _msg: None
        return
    with err_console.status(title) as status:
        yield lambda msg: status.update(f"{title}: {msg}")


def short(object_id: str | None) -> str:
    return object_id[:12] if object_id else "-"


def json_flag(value: bool) -> None:
    """Commands accept --json after their name too."""
    if value:
        OPTIONS.json = True


def exit_code_for(exc: BaseException) -> int:
    """The one mapping from an error to the CLI's exit code (each error class carries its own)."""
    if isinstance(exc, Error):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return Internal.exit_code


def report(exc: BaseException) -> int:
    """Print what went wrong — one line for our errors, never a traceback — and return the exit code."""
    if isinstance(exc, KeyboardInterrupt):
        err_console.print("[yellow]interrupted[/]")
    elif isinstance(exc, Error):
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
    else:
        err_console.print(f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(str(exc))}\n"
                          "This is a bug in capsule: please report it, with the command you ran "
                          "(set CAPSULE_DEBUG=1 to see the traceback).")
    return exit_code_for(exc)


FingerprintOpt = Annotated[str | None, typer.Option(
    "--fingerprint", help="The other agent's certificate fingerprint (SHA256:…, printed by `capsule serve` there) "
                          "to pin for this call; default: the known host's at that URL (`capsule host add`).")]


def peer_destination(store: Store, to: str, token_file: Path | None) -> tuple[str, str, str]:
    """A peer given on the command line as an agent URL (its token from --token-file / CAPSULE_TOKEN) or as a
    known host's name (its URL and token from `capsule host add`): (URL, token, label)."""
    from capsule import hosts
    from capsule.agentclient import read_token

    if "://" in to:
        return to, read_token(token_file), to
    peer = hosts.get(store, to)
    return peer.url, peer.token, peer.name
