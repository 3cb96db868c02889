"""CLI verbs for the peers this host knows: host add, host ls, host rm."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from capsule import hosts as lib
from capsule.agentclient import read_token
from capsule.cli import grammar
from capsule.cli.common import OPTIONS, JsonOpt, console, emit, err_console, json_flag, known_host_name, open_store
from capsule.errors import InvalidName

app = typer.Typer(help="The other hosts this one knows (its peers): the dashboard shows their capsules too.",
                  no_args_is_help=True)


@app.command()
def add(
    name: Annotated[str, typer.Argument(help="A short name for the host, e.g. home or office.")],
    url: Annotated[str, typer.Argument(help="Its agent: https://HOST:PORT (see `capsule serve`).")],
    token_file: Annotated[Path | None, typer.Option("--token-file", help="File holding that agent's token "
                                                                         "(default: CAPSULE_TOKEN).")] = None,
    fingerprint: Annotated[str | None, typer.Option(
        "--fingerprint", help="The certificate fingerprint you expect (SHA256:…, as `capsule serve` prints it on "
                              "that host): checked, pinned, no question asked.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Trust the certificate the host presents now without "
                                                          "asking (trust on first use).")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the host to answer.")]
    = lib.ADD_TIMEOUT,
    json: JsonOpt = False,
) -> None:
    """Know another host: its agent must answer with the token; its store id and its certificate are recorded.

    Like ssh's known_hosts, the fingerprint of the host's TLS certificate (SHA-256 of it) is shown and
    pinned: every later connection to it must present the same certificate, or is refused before the token
    is sent. Compare the fingerprint with the one `capsule serve` printed on that host, or pass it with
    --fingerprint. A certificate signed by a CA this machine trusts is checked against the CA instead."""
    json_flag(json)
    store = open_store()

    def confirm(cert: lib.Certificate) -> bool:
        if cert.ca_signed:
            err_console.print(f"{url} presents a CA-signed certificate ({cert.fingerprint}): checked against "
                              "the CA on every connection", soft_wrap=True)
            return True
        err_console.print(f"The authenticity of host {url} can't be established.\n"
                          f"Its certificate fingerprint is {cert.fingerprint}.", soft_wrap=True)
        if yes:
            return True
        if OPTIONS.json or not sys.stdin.isatty():
            raise InvalidName("not adding a host whose certificate nobody checked: pass --fingerprint SHA256:… "
                              "(from `capsule serve` on that host) or --yes")
        return typer.confirm("Are you sure you want to trust it and add the host?", default=False,
                             err=True)

    peer = lib.add(store, name, url, read_token(token_file), timeout=timeout, fingerprint=fingerprint,
                   confirm=confirm)
    pinned = f", certificate {peer.fingerprint}" if peer.fingerprint else ""
    emit(peer.as_dict(), lambda: console.print(f"added host [bold]{peer.name}[/] at {peer.url} "
                                               f"(store {peer.store_id}{pinned})", soft_wrap=True))


@app.command("ls")
def ls(
    offline: Annotated[bool, typer.Option("--offline", help="Do not ask the hosts whether they answer.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for all hosts together.")]
    = lib.ASK_TIMEOUT,
    json: JsonOpt = False,
) -> None:
    """List the known hosts and whether each answers now (all asked at once)."""
    json_flag(json)
    store = open_store()
    if offline:
        rows = [p.as_dict() | {"reachable": None, "error": None} for p in lib.peers(store)]
    else:
        rows = [s.as_dict() for s in lib.ask_all(store, timeout=timeout)]

    def human_view() -> None:
        if not rows:
            console.print("no hosts yet: `capsule host add NAME https://HOST:PORT --token-file FILE`")
            return
        t = Table("host", "url", "store", "certificate", "added", "answers")
        for r in rows:
            answers = ("-" if r["reachable"] is None else "[green]yes[/]" if r["reachable"]
                       else f"[red]no[/]: {r['error']}")
            cert = r["fingerprint"] or ("CA-checked" if r["url"].startswith("https://") else "none (http)")
            t.add_row(r["name"], r["url"], r["store_id"], cert,
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(r["added"])), answers)
        console.print(t)

    emit(rows, human_view)


@app.command("rm")
def rm(
    name: Annotated[str, typer.Argument(help="The host to forget: its name or its agent URL.")],
    json: JsonOpt = False,
) -> None:
    """Forget a host (nothing on it changes)."""
    json_flag(json)
    store = open_store()
    peer = lib.remove(store, known_host_name(store, name))
    emit({"removed": peer.name}, lambda: console.print(f"forgot host [bold]{peer.name}[/] ({peer.url})"))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="host", help="The other hosts this one knows: add, ls, rm.",
                   rich_help_panel=grammar.HOSTS)
