"""CLI verbs between hosts: serve, push, pull, start --from (and its old spelling run), localize, and the hash
cache (migrate: capsule/cli/migrate.py)."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from capsule import transfer
from capsule.agent.limits import Limits
from capsule.cli import grammar
from capsule.cli.common import (
    OPTIONS,
    PEER,
    FingerprintOpt,
    JsonOpt,
    TokenOpt,
    console,
    emit,
    err_console,
    json_flag,
    open_store,
    resolve_peer,
)
from capsule.errors import InvalidInput
from capsule.store import Store
from capsule.transfer.codecpick import rate_text
from capsule.units import human

NoHash = Annotated[bool, typer.Option("--no-hash", help="Do not look blocks up in the receiver's hash cache.")]
NoCompress = Annotated[bool, typer.Option("--no-compress", help="Send blocks uncompressed (overrides the "
                                                                "automatic choice).")]
ZstdLevel = Annotated[int | None, typer.Option(
    "--zstd-level", help="zstd level on the wire (1-19), overriding the automatic choice (by default each "
                         "transfer measures its link and picks the codec and level that keep it full with the "
                         "fewest bytes: xz or high zstd levels on slow links, zstd 3 or none on fast ones). From "
                         "10 an object's blocks travel as one zstd stream, one batch at a time: fewer bytes where "
                         "its batches resemble each other (new packages: ~18 % at 19), for more CPU.",
    min=1, max=19)]
OldLevel = Annotated[int | None, typer.Option("--level", hidden=True, min=1, max=19,
                                              help="The old spelling of --zstd-level.")]
Inflight = Annotated[int, typer.Option("--inflight", help="Requests in flight.", min=1, max=64)]
Batch = Annotated[int, typer.Option("--batch", help="Blocks per request.", min=1, max=1024)]
Xz = Annotated[bool, typer.Option("--xz", help="Send each object's new blocks as one xz (LZMA2, xz -6) stream, "
                                                "overriding the automatic choice (which picks xz itself on links "
                                                "slow enough): the fewest bytes (new packages: 5-9 % fewer than "
                                                "--zstd-level 19, about as slow to compress). A receiver without "
                                                "it gets zstd at --zstd-level (3 if not given).")]
NoDeltas = Annotated[bool, typer.Option("--no-deltas", help="Send every new block of a disk layer whole, not as "
                                                            "a delta against the parent version's blocks (the same "
                                                            "file in the parent, read from both versions' ext4 file "
                                                            "systems, or the block at the same offset). By default "
                                                            "deltas are measured and used where they send the "
                                                            "blocks sooner over the measured link (slow links); "
                                                            "with --xz or --zstd-level 10 and up wherever they cost "
                                                            "fewer bytes; with another codec given, never.")]
NoLike = Annotated[bool, typer.Option("--no-like", help="Send the memory image's manifest on its own, not "
                                                        "compressed against an older memory image of the same "
                                                        "capsule that the receiver holds (by default it is, where "
                                                        "the receiver holds one: a commute's manifest then costs "
                                                        "a few KB, not about 10 bytes per 4 KiB of memory in "
                                                        "use).")]
FullHashes = Annotated[bool, typer.Option("--full-hashes", help="Send whole 32-byte block hashes instead of "
                                                                "8-byte prefixes checked by the object digest.")]

cache_app = typer.Typer(no_args_is_help=True)


class BarProgress(transfer.Progress):
    """raw bytes done (bar, rate, ETA) with raw / hashed-away / wire bytes in the label."""

    def __init__(self, bar: Progress) -> None:
        self.bar = bar
        self.task = bar.add_task("connecting", total=None)
        self.total = 0
        self.wire_total = 0

    def begin(self, label: str, total: int) -> None:
        self.total += total
        self.label = label
        self.bar.update(self.task, total=self.total, description=label)

    def advance(self, n: int) -> None:
        self.bar.advance(self.task, n)

    def wire(self, total_wire: int) -> None:
        self.wire_total = total_wire
        self.bar.update(self.task, description=f"{self.label} · wire {human(total_wire)}")


def _run(fn, *args, **kw):  # noqa: ANN001, ANN202 - a thin wrapper for the progress bar
    if OPTIONS.json or not err_console.is_terminal:
        return fn(*args, progress=transfer.Progress(), **kw)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err_console, transient=True) as bar:
        return fn(*args, progress=BarProgress(bar), **kw)


def _summary(r: transfer.TransferReport) -> None:
    t = r.totals()
    console.print(f"{r.direction}ed [bold]{r.version}[/] {'to' if r.direction == 'push' else 'from'} {r.url} "
                  f"in {r.seconds:.2f}s")
    table = Table("object", "raw", "already there", "from hash cache", "sent", "on the wire", "codec")
    for o in r.objects:
        table.add_row(f"{o.role} {o.id[:12]}", human(o.raw_bytes), human(o.resumed_bytes), human(o.cache_bytes),
                      human(o.fetched_bytes), human(o.wire_bytes), codec_text(o))
    table.add_row("[bold]total[/]", human(t["raw_bytes"]), human(t["resumed_bytes"]), human(t["cache_bytes"]),
                  human(t["fetched_bytes"]), human(r.wire_bytes), "")
    console.print(table)
    if r.skipped:
        console.print(f"{len(r.skipped)} object(s) were already at the receiver")


def codec_text(o: transfer.ObjectReport) -> str:
    """The codec an object travelled in and the link it was picked for, and its deltas:
    ``zstd-3 (link 20 Mbit/s), 6487 blocks as deltas``."""
    text = (f"{o.codec} (link {rate_text(o.link_rate)})" if o.link_rate else o.codec) if o.codec else ""
    deltas = f"{o.delta_blocks} blocks as deltas" if o.delta_blocks else "deltas declined" \
        if o.deltas == "declined" else ""
    return ", ".join(t for t in (text, deltas) if t)


def _options(no_hash: bool, no_compress: bool, level: int | None, inflight: int, batch: int,
             full_hashes: bool, xz: bool = False, no_deltas: bool = False) -> transfer.Options:
    return transfer.Options(hash=not no_hash, compress=not no_compress, level=level, inflight=inflight, batch=batch,
                            full_hashes=full_hashes, xz=xz, deltas=not no_deltas)


def _zstd_level(level: int | None, zstd_level: int | None) -> int | None:
    return grammar.renamed("--level", level, "--zstd-level", zstd_level)


def push(
    ref: Annotated[str, typer.Argument(help="NAME or NAME@V to send.")],
    to: Annotated[str, typer.Option("--to", help=f"The receiving host: {PEER}.")],
    token_file: TokenOpt = None, no_hash: NoHash = False, no_compress: NoCompress = False, zstd_level: ZstdLevel = None,
    xz: Xz = False, inflight: Inflight = 8, batch: Batch = 256, full_hashes: FullHashes = False,
    fingerprint: FingerprintOpt = None, json: JsonOpt = False, level: OldLevel = None, no_deltas: NoDeltas = False,
    no_like: NoLike = False,
) -> None:
    """Send a capsule version to another host: only what it lacks travels (HCP).

    Examples:

      capsule push alice --to home

      capsule push alice@3 --to https://home.example:7070 --token-file home.token --zstd-level 19
    """
    json_flag(json)
    opts = _options(no_hash, no_compress, _zstd_level(level, zstd_level), inflight, batch, full_hashes, xz, no_deltas)
    opts.like = not no_like
    store = open_store()
    peer = resolve_peer(store, to, token_file, fingerprint)
    r = _run(transfer.push, store, ref, peer.url, peer.token, opts, fingerprint=peer.fingerprint)
    emit(r.as_dict(), lambda: _summary(r))


def pull(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="NAME or NAME@V to fetch.")],
    source: Annotated[str | None, typer.Option("--from", help=f"The sending host: {PEER}.")] = None,
    token_file: TokenOpt = None, no_hash: NoHash = False, no_compress: NoCompress = False, zstd_level: ZstdLevel = None,
    inflight: Inflight = 8, batch: Batch = 256, full_hashes: FullHashes = False, fingerprint: FingerprintOpt = None,
    json: JsonOpt = False, level: OldLevel = None,
) -> None:
    """Fetch a capsule version from another host; an interrupted pull resumes.

    Examples:

      capsule pull alice --from work

      capsule pull alice@3 --from https://work.example:7070 --token-file work.token
    """
    json_flag(json)
    if ctx.args:                       # the old spelling: capsule pull PEER NAME[@V]
        if source is not None or len(ctx.args) != 1:
            raise InvalidInput(f"unexpected {' '.join(ctx.args)!r}: give `capsule pull NAME[@V] --from PEER`")
        grammar.deprecated("`capsule pull PEER NAME`", "`capsule pull NAME --from PEER`")
        source, ref = ref, ctx.args[0]
    if source is None:
        raise InvalidInput(f"give the host to fetch it from: --from PEER ({PEER})")
    opts = _options(no_hash, no_compress, _zstd_level(level, zstd_level), inflight, batch, full_hashes)
    store = open_store()
    peer = resolve_peer(store, source, token_file, fingerprint)
    r = _run(transfer.pull, store, peer.url, ref, peer.token, opts, fingerprint=peer.fingerprint)
    emit(r.as_dict(), lambda: _summary(r))


def serve(
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT to listen on.")] = "127.0.0.1:7070",
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", help="The token clients must present (created with a fresh token if missing; "
                             "default: STORE/agent.token).")] = None,
    cert: Annotated[Path | None, typer.Option(
        "--cert", help="Your own certificate (PEM, e.g. CA-signed) instead of the host's self-signed one; "
                       "with --key.")] = None,
    key: Annotated[Path | None, typer.Option("--key", help="The private key of --cert (PEM).")] = None,
    insecure_http: Annotated[bool, typer.Option(
        "--insecure-http", help="Plain HTTP without TLS: only on a loopback --listen (tests, a local proxy). "
                                "This agent may then also send tokens over plain HTTP to other hosts.")]
    = False,
    public_url: Annotated[str | None, typer.Option(
        "--public-url", help="The URL other hosts reach this agent at, e.g. https://host.example:7070: what a "
                             "demand migration from the dashboard tells the destination to read the disks from. "
                             "Default: the scheme it serves and the --listen address; required when listening "
                             "on 0.0.0.0 or ::.")] = None,
    trust_proxy: Annotated[str | None, typer.Option(
        "--trust-proxy", metavar="ADDR[,ADDR]",
        help="Reverse proxies (IP addresses or networks) whose X-Forwarded-For and X-Forwarded-Proto headers "
             "are believed. Default: none; the connection's own address and scheme count.")] = None,
    max_connections_per_client: Annotated[int, typer.Option(
        "--max-connections-per-client", min=1,
        help="Connections one client address may hold at once (HTTP and WebSocket); one more is answered "
             "429 and closed, other clients are served as before.")] = Limits.per_client,
    header_timeout: Annotated[float, typer.Option(
        "--header-timeout", min=0.1,
        help="Seconds a connection has to send a request's headers (after it opens, or after its last answer): "
             "a client trickling them (slow-loris) is answered 408 and closed.")] = Limits.header_timeout,
    keep_alive: Annotated[float, typer.Option(
        "--keep-alive", min=0.1,
        help="Seconds an idle connection is kept open for the client's next request. A connection whose last "
             "answer is still on its way (a slow link) is not idle; one whose client stopped reading it is "
             "closed after this long without progress.")] = Limits.keep_alive,
    min_body_rate: Annotated[float, typer.Option(
        "--min-body-rate", min=0.0,
        help="Bytes per second a request's body must average over each --header-timeout while it arrives: a "
             "client trickling it (slow-loris) is answered 408 and closed; 0 turns this off.")]
    = Limits.min_body_rate,
    max_operations_per_owner: Annotated[int, typer.Option(
        "--max-operations-per-owner", min=1,
        help="Capsule operations (start, stop, suspend, snapshot, migrate, backup, …) one owner may have under way "
             "at once; one more is answered 429 with Retry-After. Operators and admins are not counted per "
             "user.")] = Limits.per_owner,
    lifecycle_workers: Annotated[int, typer.Option(
        "--lifecycle-workers", min=1,
        help="Threads for capsule operations; more wait their turn. HCP block serving has its own threads, "
             "which these never take.")] = Limits.lifecycle_workers,
    serving_workers: Annotated[int, typer.Option(
        "--serving-workers", min=1,
        help="Threads for HCP block serving and receiving pushes (LOOKUP, READ, the block stream, push).")]
    = Limits.serving_workers,
    user: Annotated[str | None, typer.Option(
        "--user", metavar="USER",
        help="Started as root, run as USER (e.g. capsule: in groups libvirt and libvirt-qemu; `make setup` makes "
             "it) with no capabilities; a root helper keeps only a fixed set of operations (memory images, the "
             "pod bridge, the file sandbox, serial consoles). The store must be USER's "
             "(`chown -R USER: STORE`).")] = None,
) -> None:
    """Run this host's agent: HCP, management calls and the dashboard over TLS, bearer-token protected.

    Callers are users with tokens (`capsule user`, `capsule token`); until the first admin user exists the
    token file's token acts as the admin. Every change is written to STORE/audit.log (`capsule audit`).

    On first start the host's key and a self-signed certificate are made in STORE/tls/ (the key 0600) and
    kept. The certificate's fingerprint (SHA256:…) is printed: other hosts pin it with `capsule host add`
    (they show it; compare it with this one) or --fingerprint, as ssh does with host keys."""
    from capsule.agent.serve import identity, trusted_proxies
    from capsule.agent.serve import public_url as own_url
    from capsule.agent.serve import serve as run_serve

    proxies = trusted_proxies(trust_proxy)   # both refused here, before anything is made or started
    public = own_url("http" if insecure_http else "https", listen, public_url)
    if user is not None:   # before the store is opened: everything it makes is USER's
        from capsule.privsep.drop import helper_pid, serve_as
        from capsule.store import default_home

        serve_as(user, (OPTIONS.home or default_home()).absolute())
        err_console.print(f"running as {user} (uid {os.getuid()}), no capabilities; root helper pid "
                          f"{helper_pid()}", soft_wrap=True)
    store = open_store()
    tf = token_file or store.home / "agent.token"
    ident = identity(store.home, listen, insecure_http=insecure_http, cert=cert, key=key)
    # one line each, never wrapped: the fingerprint is what the user compares and copies
    from capsule.accounts import users
    who = ("users and their tokens: the token file is retired since the first admin (`capsule user ls`)"
           if users.admin_exists(store) else f"token in {tf}")
    err_console.print(f"agent for store {store.home} on {ident.scheme}://{listen} ({who})", soft_wrap=True)
    if ident.fingerprint:
        made = "new host key; " if ident.created else ""
        err_console.print(f"{made}certificate fingerprint {ident.fingerprint}", soft_wrap=True)
    err_console.print(f"other hosts reach it at {public}" if public else
                      "no --public-url: demand migrations from the dashboard are refused until it is given",
                      soft_wrap=True)
    if proxies:
        err_console.print(f"X-Forwarded-For/-Proto believed from {', '.join(proxies)}", soft_wrap=True)
    store.close()
    run_serve(store.home, listen, tf, ident,
              Limits(per_client=max_connections_per_client, header_timeout=header_timeout, keep_alive=keep_alive,
                     min_body_rate=min_body_rate, per_owner=max_operations_per_owner,
                     lifecycle_workers=lifecycle_workers, serving_workers=serving_workers),
              public=public, trust_proxy=proxies)


@cache_app.command("prime")
def cache_prime(
    paths: Annotated[list[Path], typer.Argument(help="Files or directories to index (other VM images, disks).")],
    json: JsonOpt = False,
) -> None:
    """Index existing files into this host's hash cache, so their blocks never travel."""
    json_flag(json)
    store = open_store()
    cache = store.hash_cache()
    if OPTIONS.json or not err_console.is_terminal:
        result = cache.prime_paths(paths)
    else:
        with Progress(TextColumn("indexing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=err_console, transient=True) as bar:
            task = bar.add_task("indexing", total=None)
            result = cache.prime_paths(paths, progress=lambda done, total: bar.update(task, completed=done,
                                                                                       total=total))
    data = asdict(result)
    emit(data, lambda: console.print(f"indexed {result.files} file(s), {result.blocks} block(s) "
                                     f"({human(result.bytes_read)} read); {result.skipped} unchanged"
                                     + (f"; {len(result.errors)} unreadable: {result.errors[:3]}"
                                        if result.errors else "")))


@cache_app.command("stats")
def cache_stats(json: JsonOpt = False) -> None:
    """Size, entries, hits, misses, evictions and invalidations of this host's hash cache."""
    json_flag(json)
    store = open_store()
    s = store.hash_cache().stats()

    def human_view() -> None:
        t = Table("statistic", "value")
        for k, v in s.items():
            t.add_row(k, str(v))
        console.print(t)

    emit(s, human_view)


PrefetchOpt = Annotated[bool, typer.Option("--prefetch", help="With --from: pull every remaining disk block in the "
                                                             "background, so the capsule stops depending on the "
                                                             "other host.")]


def start_from(store: Store, ref: str, source: str, token_file: Path | None, fingerprint: str | None, *,
               prefetch: bool, wait: bool, timeout: float) -> None:
    """``capsule start NAME --from PEER``: start a capsule of another host here at once, its memory first and
    its disk blocks as the guest reads them (§4.3)."""
    from capsule.cli.common import progress as spinner

    peer = resolve_peer(store, source, token_file, fingerprint)
    with spinner(f"starting {ref} from {peer.label}") as say:
        r = transfer.run(store, peer.url, ref, peer.token, prefetch=prefetch, wait=wait, timeout=timeout, say=say,
                         fingerprint=peer.fingerprint)
    data = {"transfer": r.transfer.as_dict(), "remote_layers": r.remote_layers, "mode": r.start.mode,
            "domain": r.start.domain, "seconds": round(r.start.seconds, 3)}
    emit(data, lambda: console.print(
        f"{'restored' if r.start.mode == 'restore' else 'booted'} [bold]{r.start.version.ref}[/] from {peer.label}: "
        f"{human(r.transfer.wire_bytes)} moved first, {len(r.remote_layers)} layer(s) paged in on demand"))


def run(
    name: Annotated[str, typer.Argument(help="NAME or NAME@V on the other host.")],
    source: Annotated[str, typer.Option("--from", help=f"The host that holds it: {PEER}.")],
    prefetch: PrefetchOpt = False,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Wait until a booting guest is up.")] = True,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the guest.")] = 180.0,
    token_file: TokenOpt = None, fingerprint: FingerprintOpt = None, json: JsonOpt = False,
) -> None:
    """The old spelling of `capsule start NAME --from PEER`."""
    json_flag(json)
    grammar.deprecated("`capsule run NAME --from PEER`", "`capsule start NAME --from PEER`")
    start_from(open_store(), name, source, token_file, fingerprint, prefetch=prefetch, wait=wait, timeout=timeout)


def localize(json: JsonOpt = False) -> None:
    """Make every remote layer whose blocks have all arrived an ordinary local layer."""
    json_flag(json)
    from capsule.lifecycle import demand

    store = open_store()
    done = demand.localize(store)
    emit({"localized": done}, lambda: console.print(f"{len(done)} layer(s) now local"))


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel=grammar.MOVING)(push)
    app.command(rich_help_panel=grammar.MOVING, context_settings={"allow_extra_args": True})(pull)
    app.command(rich_help_panel=grammar.MOVING)(localize)
    app.add_typer(cache_app, name="cache", help="This host's persistent hash cache: prime, stats.",
                  rich_help_panel=grammar.MOVING)
    app.command(rich_help_panel=grammar.HOSTS)(serve)
    app.command(hidden=True)(run)
