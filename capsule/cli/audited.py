"""The CLI's lines in the audit log: a command that changes something, run locally, is recorded (who: the local
unix user) with its result — ``ok``, or the error's wire code. Commands that only look are not. The log is
rotated at the same size cap as the agent's (``capsule.audit``: ``CAPSULE_AUDIT_MAX_SIZE``, ``CAPSULE_AUDIT_KEEP``)."""

from __future__ import annotations

import contextlib
import pwd
import sys
from collections.abc import Iterator

from capsule import audit
from capsule.cli.common import OPTIONS, report
from capsule.store import default_home
from hashcache.errors import Error

GROUPS = frozenset({"host", "fleet", "backup", "pod", "update", "image", "cache", "user", "token"})
LOOKING = frozenset({"ls", "show", "tree", "doctor", "console", "serve", "audit", "status", "list", "log",
                     "plan", "stats", "history", "info"})
ON_A_CAPSULE = frozenset({"create", "derive", "rm", "promote", "start", "suspend", "snapshot", "stop", "push",
                          "pull", "run", "migrate", "localize", "chown"})
GLOBAL_WITH_VALUE = frozenset({"--home"})


def command_of(argv: list[str]) -> tuple[list[str], str | None]:
    """The command words (``["user", "add", "alice"]``: with the argument right after them) and, for a verb on
    a capsule, that argument as the capsule."""
    rest = list(argv)
    while rest and rest[0].startswith("-"):          # global options before the command
        rest = rest[2:] if rest[0] in GLOBAL_WITH_VALUE else rest[1:]
    if not rest:
        return [], None
    n = 2 if rest[0] in GROUPS and len(rest) > 1 and not rest[1].startswith("-") else 1
    cmd, after = rest[:n], rest[n:n + 1]
    first = after[0] if after and not after[0].startswith("-") else None
    if cmd[-1] in ON_A_CAPSULE:
        return cmd, first
    return cmd + ([first[:64]] if first else []), None


def _unix_user() -> str:
    from capsule import privsep

    uid = privsep.invoked_by()   # who ran it (root), not the store's owner it switched to
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class Outcome:
    result = "ok"

    def failed(self, exc: BaseException) -> None:
        self.result = exc.code if isinstance(exc, Error) else "interrupted" if isinstance(
            exc, KeyboardInterrupt) else "internal"


@contextlib.contextmanager
def audited_command(argv: list[str]) -> Iterator[Outcome]:
    """Around the whole command: the line is written when it ends (``Outcome.failed`` says how it failed)."""
    cmd, capsule = command_of(argv)
    outcome = Outcome()
    verb = (cmd[1] if len(cmd) > 1 else None) if cmd and cmd[0] in GROUPS else (cmd[0] if cmd else None)
    changes = verb is not None and verb not in LOOKING and "--help" not in argv and not (
        verb == "verify" and "--fix-modes" not in argv)
    try:
        rotation = audit.Rotation.from_env() if changes else None
    except Error as exc:            # a bad CAPSULE_AUDIT_* setting: the command is refused, not run
        sys.exit(report(exc))
    try:
        yield outcome
    except SystemExit as exc:
        if exc.code not in (0, None) and outcome.result == "ok":
            outcome.result = f"exit_{exc.code}"
        raise
    finally:
        home = (OPTIONS.home or default_home()).absolute()
        if changes and (home / "store.json").exists():
            with contextlib.suppress(OSError):
                audit.record(home, who=f"unix:{_unix_user()}", action="capsule " + " ".join(cmd), capsule=capsule,
                             remote="local", result=outcome.result, via="cli", rotation=rotation)
