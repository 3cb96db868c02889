"""Shared CLI plumbing: the store option, --json output, progress, errors, and the options and the resolver of
the grammar every command follows (capsule/cli/grammar.py): PEER, --token-file, --fingerprint, --json."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from capsule.errors import NotFound
from capsule.store import Store
from hashcache.errors import Error, Internal

if TYPE_CHECKING:
    from capsule.hosts import Peer

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


JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]

PEER = ("a known host's name (`capsule host ls`: its token and pinned certificate come from there) or an agent "
        "URL https://HOST:PORT (with --token-file and --fingerprint)")
TokenOpt = Annotated[Path | None, typer.Option(
    "--token-file", help="With an agent URL: the file holding that agent's token (default: CAPSULE_TOKEN, else "
                         "the known host's at that URL). With a known host's name: instead of its own.")]
FingerprintOpt = Annotated[str | None, typer.Option(
    "--fingerprint", help="The other agent's certificate fingerprint (SHA256:…, printed by `capsule serve` there) "
                          "to pin for this call; default: the known host's (`capsule host add`).")]


@dataclass(frozen=True)
class PeerCall:
    """Where and how to call a peer named on the command line."""

    url: str
    token: str = field(repr=False)
    label: str                   # how to name it to the user: the known host's name, else the URL
    fingerprint: str | None      # None: the known host's pin at that URL, if any (hosts.pin_for)


def _known_at(store: Store, url: str) -> Peer | None:
    from capsule import hosts

    return next((p for p in hosts.peers(store) if p.url == url), None)


def resolve_peer(store: Store, peer: str, token_file: Path | None = None,
                 fingerprint: str | None = None) -> PeerCall:
    """The one reading of a PEER on the command line (see capsule.cli.grammar): a known host's name (its URL,
    token and pin from `capsule host add`; --token-file and --fingerprint override them) or an agent URL (its
    token from --token-file, else CAPSULE_TOKEN, else the known host's at that URL; its pin --fingerprint,
    else the known host's at that URL)."""
    from capsule import hosts
    from capsule.agentclient import read_token
    from hashcache.transport.base import TOKEN_ENV

    if "://" not in peer:
        known = hosts.get(store, peer)
        token = read_token(token_file) if token_file is not None else known.token
        return PeerCall(known.url, token, known.name, fingerprint or known.fingerprint)
    url = hosts.check_url(peer)
    at = _known_at(store, url)
    if token_file is None and at is not None and not os.environ.get(TOKEN_ENV, "").strip():
        token = at.token
    else:
        token = read_token(token_file)
    return PeerCall(url, token, at.name if at else url, fingerprint or (at.fingerprint if at else None))


def known_host_name(store: Store, peer: str) -> str:
    """The name of a host this one must know already (a backup copy's target, a fleet member): a PEER given as
    a name is that name (checked where it is used), as a URL the name of the known host there."""
    from capsule import hosts

    if "://" not in peer:
        return peer
    url = hosts.check_url(peer)
    known = _known_at(store, url)
    if known is None:
        raise NotFound(f"no known host at {url}: add it first (`capsule host add NAME {url} --token-file FILE`)")
    return known.name
