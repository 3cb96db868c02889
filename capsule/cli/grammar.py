"""The grammar of the ``capsule`` command line: the rules every command follows. Read them before adding one;
``tests/unit/test_cli_grammar.py`` walks the whole CLI and fails on a command that breaks them.

1. **A peer is PEER everywhere**: a known host's name (``capsule host ls``; its URL, token and pinned
   certificate come from there) or an agent URL ``https://HOST:PORT`` (its token from ``--token-file`` or
   ``CAPSULE_TOKEN``, its certificate pinned with ``--fingerprint`` or the known host's at that URL). One
   resolver reads it: :func:`capsule.cli.common.resolve_peer` for a call to the peer (push, pull,
   start --from, migrate, pod migrate --on), :func:`capsule.cli.common.known_host_name` where the host must be
   known already (backup copies, fleet members, host rm). ``capsule host add NAME URL`` and
   ``capsule fleet add NAME URL`` define a peer; they are the only commands that take a peer's URL as an
   argument. A capsule repository is not a peer: ``capsule repo …`` commands take its ``s3://HOST:PORT/BUCKET/
   PREFIX`` URL as an argument, and ``backup schedule NAME --to`` and ``start NAME --from`` take either a PEER
   or such a URL.
2. **``--to`` and ``--from`` name a place**: where something goes, where it comes from. The place is a PEER
   (``push NAME --to PEER``, ``pull NAME --from PEER``, ``start NAME --from PEER``, ``migrate NAME --to
   PEER``, ``backup schedule NAME --to PEER``, ``fleet push NAME@V --to PEER``), except for pods, whose place
   is a capsule: ``pod migrate CAPSULE/POD --to CAPSULE [--on PEER]``, ``pod restore IMAGE --to CAPSULE``.
   ``--on PEER`` says which host that capsule is on. Never ``--host``, never ``--into``.
3. **A version is ``NAME@V``**, given where the capsule is named (``fleet rollback web@3``, ``backup restore
   desk@12``, ``update apply alice --system web@4``); never as an option value of its own like ``--to @3``.
4. **One option name per setting, one setting per option name** (:data:`RENAMED` lists the names that are
   gone): ``--zstd-level`` and ``--xz`` for how blocks are compressed on the wire, ``--token-file`` and
   ``--fingerprint`` for a URL's credentials, ``--timeout`` (seconds) for how long to wait, ``--every`` for a
   job's calendar, ``--memory`` for a guest's RAM size (``backup schedule --with-memory`` for a snapshot with
   memory), ``--json`` for machine-readable output (stdout holds only the JSON; warnings and progress go to
   stderr).
5. **A verb means one thing everywhere** (:data:`VERBS`: its meaning and the groups that use it). A capsule is
   ``suspend``-ed (saved and stopped) and ``start``-ed again; a pod is ``freeze``-d in place and ``thaw``-ed.
6. **``--help`` is grouped by task**: every visible command at the top level, and in a group of
   :data:`PANEL_MIN` commands or more, has a ``rich_help_panel`` (the top level's are :data:`PANELS`).
7. **Every option has help text**, and a ``--to``/``--from``/``--on`` says what it takes: a host's name or
   URL (a capsule, for pods).
8. **An old spelling keeps working for one release** after it is renamed: hidden from ``--help``, it does
   what the new one does after :func:`deprecated` prints on stderr which spelling replaces it (until
   :data:`REMOVED_AFTER`)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

REMOVED_AFTER = "0.2"

# the top level's help panels, in the order --help shows them
CAPSULES = "Capsules"
RUNNING = "Running"
MOVING = "Moving between hosts"
HOSTS = "Hosts and fleets"
BACKUPS = "Backups"
PODS = "Pods"
IMAGES = "Images and updates"
USERS = "Users and security"
DIAGNOSTICS = "Store and diagnostics"
PANELS = (CAPSULES, RUNNING, MOVING, HOSTS, BACKUPS, PODS, IMAGES, USERS, DIAGNOSTICS)
PANEL_MIN = 6

# option names that are gone, and what replaced them
RENAMED = {
    "--host": "--to/--from PEER (a place), --on PEER (the host a pod's capsule is on)",
    "--level": "--zstd-level",
    "--into": "--to CAPSULE",
    "--schedule": "--every CALENDAR (as `backup schedule` takes it)",
}
PLACES = ("--to", "--from", "--on")

TOP = ""
# verb -> (what it means, the groups that use it: "" is the top level)
VERBS: dict[str, tuple[str, frozenset[str]]] = {
    "create": ("make a new capsule, pod or token", frozenset({TOP, "pod", "token"})),
    "derive": ("make a child capsule sharing every layer of its parent", frozenset({TOP})),
    "ls": ("list", frozenset({TOP, "host", "fleet", "backup", "pod", "image", "user", "token", "repo"})),
    "show": ("show one capsule version", frozenset({TOP})),
    "tree": ("draw the layer hierarchy", frozenset({TOP})),
    "promote": ("fold a layer's parent into it", frozenset({TOP})),
    "rm": ("remove from where it is listed (a capsule, a version, a known host, a fleet member, a user, a "
           "repository key)", frozenset({TOP, "host", "fleet", "user", "repo"})),
    "init": ("make a new, empty repository", frozenset({"repo"})),
    "check": ("check a repository is whole (every block indexed, every pack present and intact)",
              frozenset({"repo"})),
    "forget": ("drop a version from a repository (prune frees its blocks)", frozenset({"repo"})),
    "unlock": ("remove a repository's locks of pushes and prunes that died", frozenset({"repo"})),
    "upgrade": ("make a repository the newest format (what is stored stays as it is)", frozenset({"repo"})),
    "gc": ("collect unreferenced objects", frozenset({TOP})),
    "verify": ("re-hash stored objects against their digests", frozenset({TOP, "backup"})),
    "doctor": ("check this host", frozenset({TOP})),
    "start": ("boot or restore a capsule here (from this store, or --from a peer or a repository, demand-paged)",
              frozenset({TOP})),
    "suspend": ("save a running capsule (memory and disks) as a new version and stop it", frozenset({TOP})),
    "snapshot": ("record a running capsule as a new version; it keeps running", frozenset({TOP})),
    "stop": ("shut a capsule down, keeping its disks as a new version", frozenset({TOP})),
    "console": ("attach to a capsule's serial console", frozenset({TOP})),
    "push": ("send a version to other hosts (or into a repository)", frozenset({TOP, "fleet", "repo"})),
    "pull": ("fetch a version from another host", frozenset({TOP})),
    "migrate": ("move a running capsule or pod to another place; it runs there after",
                frozenset({TOP, "pod"})),
    "localize": ("make remote layers local once all their blocks are here", frozenset({TOP})),
    "serve": ("run this host's agent", frozenset({TOP})),
    "prime": ("index files into the hash cache", frozenset({"cache"})),
    "stats": ("print counters", frozenset({"cache", "repo"})),
    "add": ("add to a list (a known host, a fleet member, a user, a repository key)",
            frozenset({"host", "fleet", "user", "repo"})),
    "status": ("ask every member what it holds and runs", frozenset({"fleet"})),
    "rollback": ("put an earlier version back on the fleet", frozenset({"fleet"})),
    "schedule": ("run a job on a calendar", frozenset({"backup"})),
    "unschedule": ("drop a job's calendar", frozenset({"backup"})),
    "run": ("do a scheduled job now, outside its schedule", frozenset({"backup"})),
    "prune": ("remove what is no longer kept: backups a retention policy drops, a repository's unused blocks",
              frozenset({"backup", "repo"})),
    "restore": ("start again from a saved image (a backup version, a pod image, a repository's version)",
                frozenset({"backup", "pod", "repo"})),
    "files": ("read files from a version's disk without booting it", frozenset({"backup"})),
    "exec": ("run a command inside a pod", frozenset({"pod"})),
    "freeze": ("pause every process of a pod in place (nothing is saved)", frozenset({"pod"})),
    "thaw": ("let a frozen pod's processes run again", frozenset({"pod"})),
    "kill": ("end every process of a pod and remove it", frozenset({"pod"})),
    "checkpoint": ("save a pod into a pod image in the store", frozenset({"pod"})),
    "checkpoint-group": ("checkpoint pods that talk to each other as one group", frozenset({"pod"})),
    "restore-group": ("restart every pod of a group image", frozenset({"pod"})),
    "make": ("make a software update inside a capsule", frozenset({"update"})),
    "apply": ("move a capsule to a new system version", frozenset({"update"})),
    "build": ("build a guest image", frozenset({"image"})),
    "passwd": ("set a user's password", frozenset({"user"})),
    "revoke": ("end a token", frozenset({"token"})),
    "chown": ("give a capsule to a user", frozenset({TOP})),
    "audit": ("read the audit log", frozenset({TOP})),
}
GROUPS = frozenset({"cache", "host", "fleet", "backup", "pod", "update", "image", "user", "token", "repo", "key"})

F = TypeVar("F", bound=Callable[..., Any])


def deprecated(old: str, new: str) -> None:
    """Say on stderr (never on stdout, which may hold --json output) that ``old`` is going and ``new``
    replaces it."""
    sys.stderr.write(f"warning: {old} is deprecated and will be removed after {REMOVED_AFTER}: use {new}\n")
    sys.stderr.flush()


def renamed(old: str, old_value: Any, new: str, value: Any) -> Any:
    """The value of a renamed option: the old spelling's (with the warning) if it was given, else the new's."""
    if old_value is None:
        return value
    deprecated(old, new)
    return old_value


def alias(app: typer.Typer, old: str, new: str, fn: F) -> None:
    """Register ``fn`` again under the old command name ``old`` (its last word), hidden, warning first."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        deprecated(f"`capsule {old}`", f"`capsule {new}`")
        return fn(*args, **kwargs)

    app.command(old.split()[-1], hidden=True)(command)
