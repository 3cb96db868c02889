"""CLI verbs for scheduled backups: backup schedule, ls, unschedule, run, prune, restore, files, verify."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from capsule.backup import files as backup_files
from capsule.backup import jobs, runner, verifyjob
from capsule.backup.retention import Policy
from capsule.cli import grammar
from capsule.cli.common import JsonOpt, console, emit, json_flag, known_host_name, open_store, progress
from capsule.cli.runtime import KeyFileOpt
from capsule.errors import Conflict, InvalidInput
from capsule.repo import backups as repo_backups
from capsule.units import human

app = typer.Typer(
    help="Scheduled backup snapshots of running capsules, with retention and restore.\n\n"
    "A backup is a snapshot version (NAME@V) noted as a backup: it costs only what changed since the last "
    "one, and shares every layer with the capsule's other versions.\n\n"
    "Examples:\n\n"
    "  capsule backup schedule desk --every 'mon..fri 21:00' --keep-daily 7 --keep-weekly 4\n\n"
    "  capsule backup schedule desk --every '*:0/15' --keep-last 4 --keep-hourly 24\n\n"
    "  capsule backup ls\n\n"
    "  capsule backup run desk\n\n"
    "  capsule backup prune desk --dry-run\n\n"
    "  capsule backup restore desk@12 --as desk-tuesday\n\n"
    "  capsule backup files desk@12 /home/ann/notes.txt\n\n"
    "  capsule backup verify --every 'Sun 04:00'",
    no_args_is_help=True,
)
SCHEDULES = "Schedules"
BACKING_UP = "Backing up"
RESTORING = "Restoring"


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@app.command(rich_help_panel=SCHEDULES)
def schedule(
    name: Annotated[str, typer.Argument(help="The capsule to back up (it must exist; it is snapshotted while it "
                                             "runs).")],
    every: Annotated[str, typer.Option("--every", help="When, as a systemd calendar event: hourly, daily, weekly, "
                                                       "'mon..fri 21:00', '*:0/15' (every 15 minutes), "
                                                       "'Sat,Sun 03:00', '*-*-01 02:00'; local time unless it "
                                                       "ends in UTC or a zone like Europe/Berlin.")],
    keep_last: Annotated[int, typer.Option("--keep-last", help="Keep the N newest backups.")] = 0,
    keep_hourly: Annotated[int, typer.Option("--keep-hourly", help="Keep the newest backup of each of the last N "
                                                                   "hours that have one.")] = 0,
    keep_daily: Annotated[int, typer.Option("--keep-daily", help="… of each of the last N days.")] = 0,
    keep_weekly: Annotated[int, typer.Option("--keep-weekly", help="… of each of the last N ISO weeks.")] = 0,
    keep_monthly: Annotated[int, typer.Option("--keep-monthly", help="… of each of the last N months.")] = 0,
    keep_yearly: Annotated[int, typer.Option("--keep-yearly", help="… of each of the last N years.")] = 0,
    keep_within: Annotated[str | None, typer.Option("--keep-within", help="Keep every backup newer than this "
                                                                          "before the latest: 2d, 12h, 1m, "
                                                                          "1y6m.")] = None,
    to: Annotated[str | None, typer.Option("--to", help="A host to copy each backup to with HCP (only what it "
                                                        "lacks travels): a known host's name or its agent URL "
                                                        "(`capsule host add` it first: the agent makes the "
                                                        "copies later with its token). If it is down, the "
                                                        "copies wait for the next run. Or a repository URL "
                                                        "s3://HOST:PORT/BUCKET/PREFIX (`capsule repo init` it; "
                                                        "the agent opens it with CAPSULE_REPO_KEY_FILE or "
                                                        "CAPSULE_REPO_PASSPHRASE and the AWS credentials from "
                                                        "its environment).")] = None,
    to_keep: Annotated[str | None, typer.Option("--to-keep", help="The backup host's own policy for its copies, "
                                                                  "e.g. 'daily=30,weekly=12,monthly=24' (the "
                                                                  "--keep-* rules; default: the same as here). "
                                                                  "It prunes after every copy.")] = None,
    memory: Annotated[bool, typer.Option("--with-memory", help="Snapshot with memory (the default): the guest "
                                                               "pauses while it is saved and resumes where it "
                                                               "was.")] = False,
    disk_only: Annotated[bool, typer.Option("--disk-only", help="Disks only, no memory: the guest's file "
                                                                "systems are frozen for a moment (crash-"
                                                                "consistent if its agent does not answer); it "
                                                                "boots when restored.")] = False,
    json: JsonOpt = False,
    old_memory: Annotated[bool | None, typer.Option("--memory", hidden=True,
                                                    help="The old spelling of --with-memory.")] = None,
) -> None:
    """Back up NAME on a calendar, and prune by a policy after every run (restic's --keep-* rules).

    Without --keep-* options every backup is kept. Scheduling a capsule again changes its schedule.

    The agent (`capsule serve`) runs the schedule; a run missed while it was down is done once at start.

    Examples:

      capsule backup schedule desk --every daily --keep-daily 7 --keep-weekly 4 --keep-monthly 6

      capsule backup schedule build --every '*:0/15' --keep-last 8 --keep-within 2d

      capsule backup schedule desk --every daily --keep-daily 7 --to vault --to-keep daily=30,monthly=12
    """
    json_flag(json)
    memory = grammar.renamed("--memory", old_memory, "--with-memory", memory)
    if memory and disk_only:
        raise Conflict("--with-memory and --disk-only exclude each other: give one")
    policy = Policy(last=keep_last, hourly=keep_hourly, daily=keep_daily, weekly=keep_weekly,
                    monthly=keep_monthly, yearly=keep_yearly, within=keep_within)
    store = open_store()
    there = Policy.parse(to_keep) if to_keep is not None else None
    if to is not None and repo_backups.is_repository(to):
        target: str | None = repo_backups.check_target(to)
    else:
        target = known_host_name(store, to) if to is not None else None
    job, created = jobs.schedule(store, name, every, policy, mode="disk-only" if disk_only else "memory",
                                 target=target, target_policy=there)

    def human_view() -> None:
        console.print(f"{'scheduled' if created else 'rescheduled'} backups of [bold]{name}[/]: "
                      f"{job.event.normalized()} ({job.mode}); {job.policy.describe()}")
        if job.target:
            console.print(f"  copied to {job.target}, which keeps {job.there_policy.describe()}")
        console.print(f"  next run {_when(job.next_run)}")

    emit(job.as_dict() | {"created_now": created}, human_view)


@app.command("ls", rich_help_panel=SCHEDULES)
def ls(
    name: Annotated[str | None, typer.Argument(help="A capsule: list its backups too.")] = None,
    json: JsonOpt = False,
) -> None:
    """List the backup schedules with their last results; with NAME, also that capsule's backups.

    Examples:

      capsule backup ls

      capsule backup ls desk --json
    """
    json_flag(json)
    store = open_store()
    rows = [jobs.get(store, name)] if name else jobs.jobs(store)
    data = [j.as_dict() for j in rows]
    if name:
        data[0]["backups"] = [{"ref": v.ref, "version": v.number, "created": v.created, "note": v.note}
                              for v in jobs.backups(store, name)]

    check = verifyjob.get(store)

    def human_view() -> None:
        if check is not None:
            console.print(f"verify job: {check.calendar}, next run {_when(check.next_run)}, last run "
                          f"{_when(check.last_run)}" + (f" {check.last_result}" if check.last_result else "")
                          + (f": {check.last_error}" if check.last_error else ""))
        if not rows:
            console.print("no backup schedules yet: `capsule backup schedule NAME --every daily --keep-daily 7`")
            return
        t = Table("capsule", "every", "keep", "to", "next run", "last run", "result", "took", "paused", "bytes")
        for j in rows:
            result = ("-" if j.last_result is None else "[green]ok[/]" if j.last_result == "ok"
                      else f"[red]{j.last_result}[/]: {j.last_error}")
            if j.running_since is not None:
                result = "[yellow]running[/]"
            there = f" ({j.target_policy.describe()})" if j.target_policy else ""
            t.add_row(j.capsule, j.event.normalized(), j.policy.describe(), f"{j.target}{there}" if j.target else "-",
                      _when(j.next_run),
                      _when(j.last_run), result, "-" if j.last_duration is None else f"{j.last_duration:.1f}s",
                      "-" if j.last_pause is None else f"{j.last_pause:.2f}s",
                      "-" if j.last_bytes is None else human(j.last_bytes))
        console.print(t)
        if name:
            for b in data[0]["backups"]:
                console.print(f"  {b['ref']}  {_when(b['created'])}  {b['note']}")

    emit(data, human_view)


@app.command(rich_help_panel=SCHEDULES)
def unschedule(
    name: Annotated[str, typer.Argument(help="The capsule whose schedule to drop.")],
    json: JsonOpt = False,
) -> None:
    """Stop backing NAME up. The backups already made stay (`capsule backup prune`, `capsule rm NAME@V`)."""
    json_flag(json)
    job = jobs.unschedule(open_store(), name)
    emit({"unscheduled": job.capsule}, lambda: console.print(f"no more backups of [bold]{job.capsule}[/] "
                                                             f"(was {job.event.normalized()})"))


@app.command(rich_help_panel=BACKING_UP)
def run(
    name: Annotated[str, typer.Argument(help="A scheduled capsule.")],
    json: JsonOpt = False,
) -> None:
    """Back NAME up now, outside its schedule (then prune), and record the result on its schedule.

    Example:

      capsule backup run desk
    """
    json_flag(json)
    store = open_store()
    with progress(f"backing up {name}") as say:
        result = runner.run(store, name, say=say)

    def human_view() -> None:
        if result.ok:
            console.print(f"backed up [bold]{name}@{result.version}[/] in {result.seconds:.1f}s "
                          f"(guest paused {result.pause:.2f}s, {human(result.nbytes or 0)} new)")
            if result.pruned and result.pruned.removed:
                console.print(f"  pruned {', '.join(f'@{n}' for n in result.pruned.removed)}")
            if result.copy and result.copy.copied:
                console.print(f"  copied {', '.join(f'@{n}' for n in result.copy.copied)} to {result.copy.target} "
                              f"({human(result.copy.wire_bytes)} on the wire)")
            if result.copy and result.copy.pruned:
                console.print(f"  pruned {', '.join(f'@{n}' for n in result.copy.pruned)} on {result.copy.target}")
        else:
            console.print(f"[red]backup of {name} failed[/]: {result.error}")

    emit(result.as_dict(), human_view)
    if not result.ok:
        raise typer.Exit(1)


@app.command(rich_help_panel=BACKING_UP)
def prune(
    name: Annotated[str, typer.Argument(help="A scheduled capsule.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only say what would be kept (and by which rule) and "
                                                            "what removed.")] = False,
    json: JsonOpt = False,
) -> None:
    """Apply NAME's retention policy to its backups: remove the versions it does not keep.

    Then only what nothing else uses is collected: layers shared with other versions or capsules stay.

    Example:

      capsule backup prune desk --dry-run
    """
    json_flag(json)
    result = runner.prune(open_store(), name, dry_run=dry_run)

    def human_view() -> None:
        if not result.decisions:
            console.print(f"{name} has no backups yet")
            return
        t = Table("backup", "taken", "", "why")
        for d in result.decisions:
            t.add_row(f"{name}@{d.snapshot.number}", _when(d.snapshot.time),
                      "[green]keep[/]" if d.keep else "[red]remove[/]", ", ".join(d.reasons))
        console.print(t)
        verb = "would remove" if dry_run else "removed"
        console.print(f"{verb} {len(result.removed)} backup(s)"
                      + ("" if dry_run else f", freed {human(result.freed_bytes)}"))

    emit(result.as_dict(), human_view)


@app.command(rich_help_panel=RESTORING)
def restore(
    ref: Annotated[str, typer.Argument(help="The backup, NAME@V (see `capsule backup ls NAME`).")],
    as_name: Annotated[str | None, typer.Option("--as", help="Start it as a new capsule of this name (NAME keeps "
                                                             "running). Without it the backup becomes NAME's "
                                                             "new latest version and starts (NAME must be "
                                                             "stopped or suspended).")] = None,
    source: Annotated[str | None, typer.Option("--from", help="A capsule repository's URL, "
                                                              "s3://HOST:PORT/BUCKET/PREFIX (s3+http://… without "
                                                              "TLS): the backup comes from there, onto a host that "
                                                              "may never have held it.")] = None,
    live: Annotated[bool, typer.Option("--live", help="With --from: start it at once, its disks paged in from the "
                                                      "repository as the guest reads them and the rest pulled in "
                                                      "the background (without it, the whole backup is "
                                                      "downloaded first).")] = False,
    key_file: KeyFileOpt = None,
    json: JsonOpt = False,
) -> None:
    """Start a backup: as a new capsule (--as NEW), or as the new latest version of the same capsule. With
    --from a repository, the backup comes from there first; with --live it boots at once and its disks follow.

    Examples:

      capsule backup restore desk@12 --as desk-tuesday

      capsule suspend desk && capsule backup restore desk@12

      capsule backup restore desk@12 --from s3://store:8333/backups/office --live
    """
    json_flag(json)
    if source is None and (live or key_file is not None):
        raise InvalidInput("--live and --key-file restore a backup from a repository: give --from "
                           "s3://HOST:PORT/BUCKET/PREFIX too; nothing was changed")
    if source is not None and not repo_backups.is_repository(source):
        raise InvalidInput(f"--from {source!r}: a backup restores from a capsule repository "
                           "s3://HOST:PORT/BUCKET/PREFIX (s3+http://… without TLS); a backup host's copy starts "
                           "with `capsule start NAME@V --from HOST`; nothing was changed")
    store = open_store()
    if source is not None:
        from capsule.repo import crypto
        from capsule.repo.repository import Repository, connect

        repo = Repository.open(connect(source), crypto.read_secret(key_file))
        with progress(f"restoring {ref} from {repo.location.url}") as say:
            came = repo_backups.restore_from(store, ref, repo, as_name=as_name, live=live, say=say)
        data = came.as_dict()
        paged = (f"; {len(data['remote_layers'])} layer(s) paged in from the repository, the rest following"
                 if live else "")
        emit(data, lambda: console.print(
            f"restored {ref} from {data['from']} as [bold]{data['version']}[/], running ({data['mode']}, "
            f"{data['seconds']:.1f}s): {human(data['downloaded_bytes'])} downloaded first{paged}"))
        return
    with progress(f"restoring {ref}") as say:
        r = runner.restore(store, ref, as_name=as_name, say=say)
    data = r.as_dict()
    emit(data, lambda: console.print(f"restored {ref} as [bold]{r.version.ref}[/], running "
                                     f"({data['mode']}, {data['seconds']:.1f}s)"))


@app.command(rich_help_panel=RESTORING)
def files(
    ref: Annotated[str, typer.Argument(help="The backup (or any version), NAME@V.")],
    path: Annotated[str, typer.Argument(help="An absolute path inside the guest: a directory is listed, a "
                                             "file is printed (or saved with --out).")] = "/",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Save the file here instead of printing it "
                                                                 "(written whole, then renamed).")] = None,
    disk: Annotated[int, typer.Option("--disk", help="Which of the version's disks (0 is the first).")] = 0,
    json: JsonOpt = False,
) -> None:
    """Read a backup's files without booting it: list a directory, print or save a file.

    The version's disk is read from its sealed layers (flattened into a temporary sparse file, read with
    e2fsprogs' debugfs, read-only, as the unprivileged capsule-sandbox user with no capabilities: the guest
    wrote that file system); nothing in the store changes and the capsule need not be stopped.
    ext2/3/4 file systems; symbolic links are followed inside the guest.

    Examples:

      capsule backup files desk@12 /home/ann

      capsule backup files desk@12 /home/ann/notes.txt

      capsule backup files desk@12 /etc/fstab --out fstab-tuesday
    """
    json_flag(json)
    store = open_store()
    target = out if out is not None or json else store.temp_path(".out")
    try:
        with progress(f"reading {ref}'s disk"):
            found = backup_files.listing(store, ref, path, disk=disk, save_to=target)
        if found.kind == "file" and out is None and target is not None:       # printed
            with target.open("rb") as f:
                shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)
            sys.stdout.buffer.flush()
            return
    finally:
        if out is None and target is not None:
            target.unlink(missing_ok=True)
    if found.kind == "dir" and out is not None:
        raise InvalidInput(f"{found.ref}: {found.path} is a directory; --out saves a file (list it without --out)")
    result = found.as_dict() | ({"saved_to": str(out)} if out is not None else {})

    def human_view() -> None:
        if found.kind == "file":
            console.print(f"saved {found.path} ({human(found.size)}) of {found.ref} to {out}")
            return
        t = Table("name", "kind", "mode", "owner", "size", title=f"{found.ref}:{found.path}")
        for e in found.entries:
            t.add_row(e.name + ("/" if e.kind == "dir" else ""), e.kind, f"{e.mode:04o}", f"{e.uid}:{e.gid}",
                      human(e.size) if e.kind == "file" else "")
        console.print(t)

    emit(result, human_view)


@app.command(rich_help_panel=BACKING_UP)
def verify(
    names: Annotated[list[str] | None, typer.Argument(help="Scheduled capsules whose backups to check "
                                                           "(default: every capsule with backups).")] = None,
    here_only: Annotated[bool, typer.Option("--here-only", help="Do not ask the backup hosts to check their "
                                                                "copies.")] = False,
    every: Annotated[str | None, typer.Option("--every", help="Do not verify now: run the host's verify job on "
                                                              "this calendar event instead, as `backup schedule "
                                                              "--every` takes it (e.g. 'Sun 04:00'); the agent "
                                                              "runs it.")] = None,
    unschedule_job: Annotated[bool, typer.Option("--unschedule", help="Drop the verify job.")] = False,
    json: JsonOpt = False,
    schedule_on: Annotated[str | None, typer.Option("--schedule", hidden=True,
                                                    help="The old spelling of --every.")] = None,
) -> None:
    """Re-hash everything the backups reference, here and on the backup hosts their copies went to
    (each checks its own copies), and name the first broken object and the backups that use it.

    Exit code 6 when something is broken, 1 when a backup host could not be asked.

    Examples:

      capsule backup verify

      capsule backup verify desk --here-only

      capsule backup verify --every 'Sun 04:00'
    """
    json_flag(json)
    schedule_on = grammar.renamed("--schedule", schedule_on, "--every", every)
    store = open_store()
    if schedule_on is not None or unschedule_job:
        if schedule_on is not None and unschedule_job:
            raise InvalidInput("give --every CALENDAR or --unschedule, not both")
        job = verifyjob.schedule(store, schedule_on) if schedule_on is not None else verifyjob.unschedule(store)
        emit(job.as_dict() | {"scheduled": not unschedule_job},
             lambda: console.print(f"verify job: {job.calendar}, next run {_when(job.next_run)}"
                                   if not unschedule_job else "verify job dropped"))
        return
    with progress("verifying backups") as say:
        result = verifyjob.run(store, names or None, remote=not here_only, say=say)

    def human_view() -> None:
        t = Table("host", "backups", "layers", "files", "result")
        for h in result.hosts:
            verdict = (f"[red]not checked[/]: {h.error}" if h.error else
                       f"[red]{len(h.broken)} broken[/]" if h.broken else "[green]good[/]")
            t.add_row(h.host, str(len(h.backups)), str(h.checked_layers), str(h.checked_files), verdict)
        console.print(t)
        for h in result.hosts:
            for b in h.broken:
                console.print(f"[red]BROKEN[/] {b.kind} {b.id} on {b.host}"
                              + (f" (used by {', '.join(b.backups)})" if b.backups else "") + f": {b.error}")
        console.print(result.summary())

    emit(result.as_dict(), human_view)
    if result.first_broken is not None:
        raise typer.Exit(6)
    if not result.ok:
        raise typer.Exit(1)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="backup", rich_help_panel=grammar.BACKUPS)
