"""CLI verbs for capsule repositories on S3-compatible object storage: repo init, ls, check, stats, prune,
upgrade, push, restore, forget, and repo key add, rm, ls. Each is one library call (capsule.repo)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from capsule.cli import grammar
from capsule.cli.common import JsonOpt, console, emit, json_flag, open_store, progress
from capsule.errors import IntegrityError
from capsule.units import human

app = typer.Typer(
    help="Encrypted, deduplicated capsule repositories on S3-compatible object storage.\n\n"
    "A repository holds capsule versions as sealed packs of blocks (AES-256-GCM; block ids are keyed "
    "hashes), shared by every host that pushes to it: a block any of them stored is never uploaded again. "
    "Credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws/credentials. The repository's key "
    "opens with CAPSULE_REPO_PASSPHRASE, a prompt, or --key-file.\n\n"
    "Examples:\n\n"
    "  capsule repo init s3://store.example:8333/backups/lab\n\n"
    "  capsule repo push desk@12 s3://store.example:8333/backups/lab\n\n"
    "  capsule repo restore desk@12 s3://store.example:8333/backups/lab\n\n"
    "  capsule repo check s3://store.example:8333/backups/lab --read-data",
    no_args_is_help=True,
)
keys = typer.Typer(help="The keys (passphrases, key files) that open a repository.", no_args_is_help=True)
app.add_typer(keys, name="key", rich_help_panel="Keys")
REPO = "Repositories"
MOVING = "Pushing and restoring"

Url = Annotated[str, typer.Argument(help="The repository: s3://HOST:PORT/BUCKET/PREFIX (HTTPS), or "
                                         "s3+http://HOST:PORT/BUCKET/PREFIX for a store without TLS.")]
KeyFile = Annotated[Path | None, typer.Option("--key-file", help="Open the repository with this key file's "
                                                                 "bytes instead of a passphrase.")]


def _open(url: str, key_file: Path | None) -> Any:
    from capsule.repo import crypto
    from capsule.repo.repository import Repository, connect

    return Repository.open(connect(url), crypto.read_secret(key_file))


def _when(t: float | None) -> str:
    return "-" if not t else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@app.command(rich_help_panel=REPO)
def init(url: Url, key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """Make a new, empty repository (and its bucket if missing), sealed by a passphrase or --key-file."""
    json_flag(json)
    from capsule.repo import crypto
    from capsule.repo.repository import Repository, connect

    repo = Repository.init(connect(url), crypto.read_secret(key_file, confirm=True))
    out = {"url": repo.location.url, "id": repo.config["id"], "key": repo.key_id}
    emit(out, lambda: console.print(f"repository {out['id'][:12]} made at {out['url']} (key {out['key'][:12]}). "
                                    "Keep its passphrase: nothing in it can be read without a key."))


@app.command("ls", rich_help_panel=REPO)
def ls_(url: Url, key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """List the capsule versions a repository holds."""
    json_flag(json)
    from capsule.repo import maintain

    rows = maintain.listing(_open(url, key_file))

    def show() -> None:
        table = Table("version", "pushed", "from host", "objects", "note", box=None)
        for r in rows:
            table.add_row(r["version"], _when(r["pushed"]), str(r["host"]), str(r["objects"]), r["note"] or "")
        console.print(table)

    emit(rows, show)


@app.command(rich_help_panel=REPO)
def stats(url: Url, key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """Count a repository's versions, packs and blocks, and what deduplication saves."""
    json_flag(json)
    from capsule.repo import maintain

    s = maintain.stats(_open(url, key_file))
    emit(s, lambda: console.print(
        f"{s['versions']} version(s), {s['blocks']} block(s) in {s['packs']} pack(s); "
        f"{human(s['stored_bytes'])} stored for {human(s['referenced_raw_bytes'])} of distinct objects' blocks "
        f"(ratio {s['dedup_ratio']})"))


@app.command(rich_help_panel=REPO)
def check(url: Url, read_data: Annotated[bool, typer.Option("--read-data", help="Read every pack whole and "
                                                                                "check each block.")] = False,
          key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """Check that every version's blocks are indexed and their packs present.

    With --read-data every pack is read and each block checked; each bad pack is named with the versions
    that use it."""
    json_flag(json)
    from capsule.repo import maintain

    r = maintain.check(_open(url, key_file), read_data=read_data)
    emit(r.as_dict(), lambda: console.print(
        f"{r.versions} version(s), {r.packs} pack(s), {r.blocks} block(s): "
        + ("no errors" if r.ok else "\n".join(["errors:", *r.errors]))))
    if not r.ok:
        raise IntegrityError(f"the repository at {r.url} has {len(r.errors)} error(s)")


@app.command(rich_help_panel=REPO)
def prune(url: Url, dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be freed; change "
                                                                            "nothing.")] = False,
          key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """Free the blocks no version uses (after `repo forget`).

    It runs alone in the repository, under its exclusive lock."""
    json_flag(json)
    from capsule.repo import maintain

    with progress("pruning"):
        r = maintain.prune(_open(url, key_file), dry_run=dry_run)
    emit(r, lambda: console.print(
        f"{'would free' if dry_run else 'freed'} {human(max(0, r['bytes_freed']))}: {r['packs_deleted']} pack(s) "
        f"deleted, {r['packs_repacked']} repacked into {r['packs_written']}"))


@app.command(rich_help_panel=REPO)
def upgrade(url: Url, key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """Make a format-1 repository format 2, where new blocks are stored 16 neighbours to a blob.

    Format 2 stores less: neighbouring blocks compress together, and one seal and one header entry serve
    16 blocks. Nothing stored is rewritten; new pushes write format 2. A Capsule that reads only format 1
    refuses the repository afterwards, so upgrade Capsule on every host that uses it first. It runs
    alone in the repository, under its exclusive lock."""
    json_flag(json)
    r = _open(url, key_file).upgrade()
    emit(r, lambda: console.print(f"{r['url']}: format {r['from']} → {r['format']}" if r["upgraded"]
                                  else f"{r['url']} is format {r['format']} already"))


@app.command(rich_help_panel=REPO)
def forget(ref: Annotated[str, typer.Argument(help="NAME@V to drop from the repository.")], url: Url,
           key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """Drop a version from a repository (`repo prune` then frees the blocks only it used)."""
    json_flag(json)
    from capsule.repo import maintain

    names = maintain.forget(_open(url, key_file), ref)
    emit({"version": ref, "records": names}, lambda: console.print(f"forgot {ref}"))


@app.command(rich_help_panel=REPO)
def unlock(url: Url, remove_all: Annotated[bool, typer.Option(
        "--remove-all", help="Remove every lock, a live writer's too: only when no host uses the repository "
                             "(a prune could then run beside a push).")] = False,
           key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """Remove the locks of pushes and prunes that died (a crashed prune blocks every push until then).

    A dead writer's lock: one not refreshed for 30 minutes, or one taken on this host by a process that is gone.

    Pushes and prunes already pass over such locks, and prune removes them."""
    json_flag(json)
    repo = _open(url, key_file)
    removed = repo.unlock(everything=remove_all)
    emit({"removed": removed}, lambda: console.print(
        f"removed {len(removed)} lock(s)" + "".join(
            f"\n  {r['lock']}: {'prune' if r['exclusive'] else 'push, restore or check'} by {r['host']} pid "
            f"{r['pid']}, {_when(r['time'] if isinstance(r['time'], (int, float)) else None)}" for r in removed)))


@app.command(rich_help_panel=MOVING)
def push(ref: Annotated[str, typer.Argument(help="NAME or NAME@V to store.")], url: Url,
         key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """Store a capsule version in a repository, sealed.

    Only the blocks it lacks (from any capsule, any host) are uploaded."""
    json_flag(json)
    from capsule.repo.push import push as run

    store = open_store()
    repo = _open(url, key_file)
    with progress(f"pushing {ref}") as say:
        r = run(store, ref, repo, say)
    emit(r.as_dict(), lambda: console.print(
        f"{r.version} stored in {r.url}: {r.blocks_new} new block(s) of {r.blocks} ({human(r.new_bytes)} of "
        f"{human(r.raw_bytes)}), {r.objects_present} of {r.objects} object(s) already there; "
        f"{human(r.uploaded_bytes)} uploaded in {r.seconds:.1f}s"))


@app.command(rich_help_panel=MOVING)
def restore(ref: Annotated[str, typer.Argument(help="NAME or NAME@V to bring back.")], url: Url,
            key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """Bring a capsule version from a repository into this store.

    Only the layers and files it lacks are fetched, each checked against its manifest."""
    json_flag(json)
    from capsule.repo.restore import restore as run

    store = open_store()
    repo = _open(url, key_file)
    with progress(f"restoring {ref}") as say:
        r = run(store, ref, repo, say)
    emit(r.as_dict(), lambda: console.print(
        f"{r.version} restored: {len(r.installed)} object(s) installed, {r.objects_present} already here; "
        f"{human(r.downloaded_bytes)} downloaded in {r.seconds:.1f}s"))


@keys.command("ls")
def key_ls(url: Url, key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """List the keys that open a repository."""
    json_flag(json)
    rows = _open(url, key_file).list_keys()

    def show() -> None:
        table = Table("key", "made", "on host", "", box=None)
        for k in rows:
            table.add_row(k["id"], _when(k["created"]), str(k["host"]), "(this one)" if k["current"] else "")
        console.print(table)

    emit(rows, show)


@keys.command("add")
def key_add(url: Url, key_file: KeyFile = None,
            new_key_file: Annotated[Path | None, typer.Option("--new-key-file", help="Seal the new key with this "
                                                                                    "key file's bytes (default: "
                                                                                    "a new passphrase, "
                                                                                    "CAPSULE_REPO_NEW_PASSPHRASE "
                                                                                    "or a prompt).")] = None,
            json: JsonOpt = False) -> None:
    """Add a key: another passphrase or key file that opens the repository."""
    json_flag(json)
    from capsule.repo import crypto

    repo = _open(url, key_file)
    secret = crypto.read_secret(new_key_file, env="CAPSULE_REPO_NEW_PASSPHRASE", prompt="new passphrase: ",
                                confirm=True)
    key_id = repo.add_key(secret)
    emit({"id": key_id}, lambda: console.print(f"key {key_id} added"))


@keys.command("rm")
def key_rm(url: Url, key_id: Annotated[str, typer.Argument(help="The key to remove (`repo key ls`).")],
           key_file: KeyFile = None, json: JsonOpt = False) -> None:
    """Remove a key (not the one opening the repository for this command)."""
    json_flag(json)
    _open(url, key_file).remove_key(key_id)
    emit({"id": key_id, "removed": True}, lambda: console.print(f"key {key_id} removed"))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="repo", rich_help_panel=grammar.BACKUPS)
