"""CLI verbs that run capsules: start (here, or --from another host), suspend, snapshot, stop, console."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from capsule import lifecycle
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
    short,
)
from capsule.cli.transfer import PrefetchOpt, start_from
from capsule.errors import InvalidInput, NotFound
from capsule.runtime.connection import libvirt_uri
from capsule.store import Store
from capsule.units import human
from capsule.views import seal_dict, start_dict

BalloonOpt = Annotated[bool, typer.Option("--balloon", help="Zero the guest's spare memory first (§4.1): smaller "
                                                            "memory image, less to move. Needs the guest agent.")]
PolicyOpt = Annotated[str, typer.Option("--balloon-policy", help="none | cache (drop clean page cache) | "
                                                                 "aggressive (also dentries/inodes, compaction).")]
MethodOpt = Annotated[str, typer.Option("--balloon-method", help="virtio (host virtio-balloon down to what the "
                                                                 "guest uses; the default, measured best) | agent "
                                                                 "(in-guest balloon).")]


REPOSITORY = "or a capsule repository s3://HOST:PORT/BUCKET/PREFIX (s3+http://… without TLS; with --key-file)"
KeyFileOpt = Annotated[Path | None, typer.Option(
    "--key-file", help="With --from a repository: open it with this key file's bytes instead of a passphrase "
                       "(CAPSULE_REPO_PASSPHRASE, else a prompt).")]


def start_from_repository(store: Store, ref: str, url: str, key_file: Path | None, *, prefetch: bool, wait: bool,
                          timeout: float) -> None:
    """``capsule start NAME@V --from s3://…``: an instant restore, its disk blocks paged in from the repository
    as the guest reads them."""
    from capsule.repo import crypto, instant
    from capsule.repo.repository import Repository, connect

    repo = Repository.open(connect(url), crypto.read_secret(key_file))
    with progress(f"starting {ref} from {repo.location.url}") as say:
        r = instant.start(store, ref, repo, prefetch=prefetch, wait=wait, timeout=timeout, say=say)
    emit(r.as_dict(), lambda: console.print(
        f"{'restored' if r.start.mode == 'restore' else 'booted'} [bold]{r.start.version.ref}[/] from "
        f"{r.url}: {human(r.downloaded_bytes)} read first, {len(r.remote_layers)} layer(s) paged in on demand"))


def _print_seal(r: lifecycle.SealResult, verb: str) -> None:
    if r.version is None:
        console.print(f"{verb}; the disks were not written, so no new version")
        return
    parts = [f"{verb} → [bold]{r.version.ref}[/]"]
    if r.balloon:
        parts.append(f"balloon: {r.balloon.skipped}" if r.balloon.skipped else
                     f"balloon ({r.balloon.method}, {r.balloon.policy}): {human(r.balloon.held_bytes)} zeroed "
                     f"in {r.balloon.seconds:.2f}s ({r.balloon.stop_reason})")
    if r.memory:
        parts.append(f"memory image {short(r.memory.id)}: {human(r.memory.allocated)} allocated "
                     f"of {human(r.memory.size)}, saved in {r.save_seconds:.2f}s")
    for layer in r.layers:
        parts.append(f"layer {short(layer.id)}: {human(layer.stored_bytes)} of new data")
    parts.append(f"sealed in {r.seal_seconds:.2f}s")
    console.print("\n  ".join(parts))


def start(
    ref: Annotated[str, typer.Argument(help="NAME (latest version) or NAME@V.")],
    source: Annotated[str | None, typer.Option(
        "--from", help=f"Start a capsule of another host here at once, its disks paged in from there as the guest "
                       f"reads them: {PEER}, {REPOSITORY}.")] = None,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Wait until a booting guest is up.")] = True,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the guest (with --from, a boot "
                                                             "over a slow link reads its disk at the link's "
                                                             "speed).")] = 180.0,
    prefetch: PrefetchOpt = False,
    token_file: TokenOpt = None, fingerprint: FingerprintOpt = None, key_file: KeyFileOpt = None,
    json: JsonOpt = False,
) -> None:
    """Boot an inactive version or restore an active one, on a fresh private leaf per disk.

    With --from PEER the capsule is another host's: its memory image comes first (HCP), its disk blocks as
    the guest reads them (§4.3); `capsule localize` once they have all arrived. With --from s3://… it is a
    repository's (an instant restore): its memory image comes first, whole, its disk blocks from the
    repository's packs as the guest reads them, on a host that may never have held the capsule.

    Examples:

      capsule start alice

      capsule start alice@3 --from work --prefetch

      capsule start alice@3 --from s3://store.example:8333/backups/lab --prefetch
    """
    json_flag(json)
    from capsule.repo.backups import is_repository

    store = open_store()
    if source is not None and is_repository(source):
        if token_file is not None or fingerprint is not None:
            raise InvalidInput("--token-file and --fingerprint are a peer's credentials; a repository opens with "
                               "--key-file or CAPSULE_REPO_PASSPHRASE")
        start_from_repository(store, ref, source, key_file, prefetch=prefetch, wait=wait, timeout=timeout)
        return
    if key_file is not None:
        raise InvalidInput("--key-file opens a repository: give --from s3://HOST:PORT/BUCKET/PREFIX too")
    if source is not None:
        start_from(store, ref, source, token_file, fingerprint, prefetch=prefetch, wait=wait, timeout=timeout)
        return
    if prefetch or token_file is not None or fingerprint is not None:
        raise InvalidInput("--prefetch, --token-file and --fingerprint start a capsule of another host: give "
                           "--from PEER too")
    with progress(f"starting {ref}") as say:
        r = lifecycle.start(store, ref, wait=wait, timeout=timeout, say=say)
    verb = "restored" if r.mode == "restore" else ("booted" if wait else "booting")
    emit(start_dict(r), lambda: console.print(
        f"{verb} [bold]{r.version.ref}[/] as domain {r.domain} ({r.accel}) in {r.seconds:.2f}s"))


def suspend(
    name: Annotated[str, typer.Argument(help="A running capsule.")],
    balloon: BalloonOpt = False, balloon_policy: PolicyOpt = "cache", balloon_method: MethodOpt = "virtio",
    json: JsonOpt = False,
) -> None:
    """Save the running capsule (sparse memory image), seal its leaves, record a new active version."""
    json_flag(json)
    store = open_store()
    with progress(f"suspending {name}") as say:
        r = lifecycle.suspend(store, name, balloon=balloon_policy if balloon else None,
                              balloon_method=balloon_method, say=say)
    emit(seal_dict(r), lambda: _print_seal(r, "suspended"))


def snapshot(
    name: Annotated[str, typer.Argument(help="A running capsule.")],
    balloon: BalloonOpt = False, balloon_policy: PolicyOpt = "cache", balloon_method: MethodOpt = "virtio",
    json: JsonOpt = False,
) -> None:
    """Record a new active version; the guest keeps running on a new leaf."""
    json_flag(json)
    store = open_store()
    with progress(f"snapshotting {name}") as say:
        sealed, resumed = lifecycle.snapshot(store, name, balloon=balloon_policy if balloon else None,
                                             balloon_method=balloon_method, say=say)
    data = seal_dict(sealed) | {"resumed": start_dict(resumed)}

    def human() -> None:
        _print_seal(sealed, "snapshot")
        console.print(f"  running again after {resumed.seconds:.2f}s")

    emit(data, human)


def stop(
    name: Annotated[str, typer.Argument(help="A running capsule.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for a clean shutdown.")] = 30.0,
    force: Annotated[bool, typer.Option("--force", help="Power off at once.")] = False,
    json: JsonOpt = False,
) -> None:
    """Shut the guest down (forced after --timeout) and keep its disk changes as a new inactive version."""
    json_flag(json)
    store = open_store()
    with progress(f"stopping {name}") as say:
        r = lifecycle.stop(store, name, timeout=timeout, force=force, say=say)
    emit(seal_dict(r), lambda: _print_seal(r, "stopped"))


def console_cmd(
    name: Annotated[str, typer.Argument(help="A running capsule.")],
    log: Annotated[bool, typer.Option("--log", help="Print the console log instead of attaching.")] = False,
) -> None:
    """Attach to the guest's serial console (Ctrl+] detaches), or print its log."""
    store = open_store()
    inst = store.catalogue.instance(name)
    if inst is None:
        raise NotFound(f"capsule {name!r} is not running")
    if log:
        typer.echo(lifecycle.console_log(store, name).read_text(errors="replace"), nl=False)
        return
    os.execvp("virsh", ["virsh", "-c", libvirt_uri(), "console", "--force", inst.domain])


def register(app: typer.Typer) -> None:
    for fn in (start, suspend, snapshot, stop):
        app.command(rich_help_panel=grammar.RUNNING)(fn)
    app.command("console", rich_help_panel=grammar.RUNNING)(console_cmd)
