"""CLI verbs for accounts and the audit log: user add/ls/rm/passwd, token create/ls/revoke, chown, audit.
Each is a thin shell over one call of ``capsule.accounts`` or ``capsule.audit``."""

from __future__ import annotations

import sys
import time
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from capsule import audit as auditlog
from capsule.accounts import owners, tokens, users
from capsule.accounts.model import ROLES, SCOPES, parse_duration
from capsule.cli import grammar
from capsule.cli.common import OPTIONS, JsonOpt, console, emit, err_console, json_flag, open_store
from capsule.errors import InvalidName

user_app = typer.Typer(no_args_is_help=True, help=(
    "Users of this host's agent and dashboard. Roles: owner (acts on the capsules it owns), operator (on all "
    "capsules; may hold host credentials), admin (also users, hosts and fleet rollouts).\n\n"
    "The agent's old single token works as an admin's until the first admin user exists; from then on every "
    "script and peer needs a user's token (`capsule token create`)."))
token_app = typer.Typer(no_args_is_help=True, help=(
    "API tokens: each belongs to a user and has scopes (read, capsules, host, admin), at most what the user's "
    "role allows. Send one as `Authorization: Bearer TOKEN`, or put it in a token file for --token-file. A peer "
    "that pushes, pulls or pages disks from this host needs scope host; one that migrates capsules here, "
    "host,capsules.\n\n"
    "Grants (user @host) are what this host hands a peer for one job: read one capsule's or version's objects, or "
    "receive one push. Each expires, and ends with the user or token that made it."))


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _password(from_stdin: bool, prompt: str = "Password") -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\n")
    if OPTIONS.json or not sys.stdin.isatty():
        raise InvalidName("no terminal to ask for the password on: give it with --password-stdin")
    first = typer.prompt(prompt, hide_input=True, err=True)
    if typer.prompt("Again", hide_input=True, err=True) != first:
        raise InvalidName("the two passwords differ: nothing changed")
    return first


@user_app.command("add")
def user_add(
    name: Annotated[str, typer.Argument(help="The user name (lower-case letters, digits, _ . -).")],
    role: Annotated[str, typer.Option("--role", help=f"One of {', '.join(ROLES)}.")],
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read the password from the first line "
                                                                          "of standard input.")] = False,
    no_password: Annotated[bool, typer.Option("--no-password", help="No password: the user signs in with tokens "
                                                                    "only.")] = False,
    json: JsonOpt = False,
) -> None:
    """Add a user (asks for its password twice on a terminal). Adding the first admin retires the host's old
    token: make that admin's token first if scripts or peers use the old one (`capsule token create`)."""
    json_flag(json)
    store = open_store()
    password = None if no_password else _password(password_stdin)
    first_admin = role == "admin" and not users.admin_exists(store)
    u = users.add(store, name, role, password)
    emit(u.as_dict() | {"host_token_retired": first_admin},
         lambda: console.print(f"added user [bold]{u.name}[/] ({u.role})"))
    if first_admin:
        err_console.print("the first admin: the agent's token file no longer works; scripts and peers need a "
                          "user's token (`capsule token create --user NAME --scope …`)", soft_wrap=True)


@user_app.command("ls")
def user_ls(json: JsonOpt = False) -> None:
    """List the users, their roles and how many active tokens each has."""
    json_flag(json)
    store = open_store()
    active = [t for t in tokens.tokens(store) if t.state() == "active"]
    rows: list[dict[str, Any]] = [u.as_dict() | {"tokens": sum(t.user == u.name for t in active)}
                                  for u in users.users(store)]

    def human() -> None:
        if not rows:
            console.print("no users: the host's token acts as the admin (`capsule user add NAME --role admin`)")
            return
        t = Table("user", "role", "password", "tokens", "added")
        for r in rows:
            t.add_row(r["name"], r["role"], "yes" if r["password"] else "no", str(r["tokens"]), _when(r["created"]))
        console.print(t)

    emit(rows, human)


@user_app.command("rm")
def user_rm(name: Annotated[str, typer.Argument(help="The user to remove.")], json: JsonOpt = False) -> None:
    """Remove a user with its tokens and ownerships (its capsules stay; operators still act on them). The last
    admin cannot be removed."""
    json_flag(json)
    u = users.remove(open_store(), name)
    emit({"removed": u.name}, lambda: console.print(f"removed user [bold]{u.name}[/] and its tokens"))


@user_app.command("passwd")
def user_passwd(
    name: Annotated[str, typer.Argument(help="The user whose password to set.")],
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read it from standard input.")] = False,
    json: JsonOpt = False,
) -> None:
    """Set a user's password (stored as a salted scrypt hash, never as is). The user's dashboard sessions end, on
    a running agent too: they sign in again with the new password."""
    json_flag(json)
    store = open_store()
    users.get(store, name)
    u = users.set_password(store, name, _password(password_stdin, "New password"))
    emit(u.as_dict(), lambda: console.print(f"password of [bold]{u.name}[/] set"))


@token_app.command("create")
def token_create(
    user: Annotated[str, typer.Option("--user", help="Whose token.")],
    scope: Annotated[list[str], typer.Option("--scope", help=f"Repeat or comma-separate: {', '.join(SCOPES)}.")],
    expires: Annotated[str | None, typer.Option("--expires", help="Lifetime: 12h, 30d, 8w (default: until "
                                                                  "revoked).")] = None,
    json: JsonOpt = False,
) -> None:
    """Make a token and print it once: it is stored only as a hash and cannot be shown again.

    For a peer that pushes here, pulls from here or keeps backup copies here:
    `capsule token create --user ops --scope host --expires 90d > ops.token`, then on the other host
    `capsule host add NAME https://THIS-HOST:PORT --token-file ops.token`. Add `capsules` to the scopes if
    capsules migrate here or fleet rollouts activate versions here."""
    json_flag(json)
    t, secret = tokens.create(open_store(), user, scope, parse_duration(expires) if expires else None)

    def human() -> None:
        console.print(secret, soft_wrap=True)
        err_console.print(f"token {t.id} for {t.user} ({', '.join(sorted(t.scopes))}), expires "
                          f"{_when(t.expires) if t.expires else 'never'}: keep it now, it is not shown again")

    emit(t.as_dict() | {"token": secret}, human)


@token_app.command("ls")
def token_ls(user: Annotated[str | None, typer.Option("--user", help="Only this user's (@host: the grants).")]
             = None, json: JsonOpt = False) -> None:
    """List tokens (never their secrets): id, user, what it allows, state, who made it. A user's token allows its
    scopes; a grant (user @host: made for a fleet pull, a demand run's destination, a push) allows one job —
    read NAME or NAME@V, or push NAME@V — and names who made it (user/token, unix:NAME for this command line)."""
    json_flag(json)
    rows: list[dict[str, Any]] = [t.as_dict() for t in tokens.tokens(open_store(), user)]

    def allows(r: dict) -> str:
        if r["allow"] is None:
            return ",".join(r["scopes"]) if r["user"] != tokens.HOST_USER else "(old host grant: refused)"
        return f"{r['allow']} {r['capsule']}{'' if r['version'] is None else '@' + str(r['version'])}"

    def human() -> None:
        if not rows:
            console.print("no tokens")
            return
        t = Table("id", "user", "allows", "state", "made by", "created", "expires")
        for r in rows:
            by = "-" if r["issuer"] is None else r["issuer"] + (f"/{r['issuer_token']}" if r["issuer_token"] else "")
            t.add_row(r["id"], r["user"], allows(r), r["state"], by, _when(r["created"]), _when(r["expires"]))
        console.print(t)

    emit(rows, human)


@token_app.command("revoke")
def token_revoke(tid: Annotated[str, typer.Argument(help="The token's id (`capsule token ls`).")],
                 json: JsonOpt = False) -> None:
    """Revoke a token (or a grant): the next call with it is refused, and so is every grant it made."""
    json_flag(json)
    t = tokens.revoke(open_store(), tid)
    emit(t.as_dict(), lambda: console.print(f"revoked token {t.id} of {t.user}"))


def chown(
    name: Annotated[str, typer.Argument(help="The capsule.")],
    user: Annotated[str, typer.Argument(help="Its new owner (a user of any role).")],
    json: JsonOpt = False,
) -> None:
    """Give a capsule to a user.

    An owner sees and acts on only the capsules it owns (a capsule made through the agent is its maker's
    already)."""
    json_flag(json)
    owners.set_owner(open_store(), name, user)
    emit({"capsule": name, "owner": user}, lambda: console.print(f"{name} is owned by [bold]{user}[/]"))


def audit(
    since: Annotated[str | None, typer.Option("--since", help="Only entries since: an age (30m, 1h, 2d) or an "
                                                              "ISO time (2026-01-31T12:00, UTC).")] = None,
    user: Annotated[str | None, typer.Option("--user", help="Only this user's (or host-token, unix:NAME).")] = None,
    json: JsonOpt = False,
) -> None:
    """Read the audit log: who changed what, when, from where.

    STORE/audit.log and its rotated files audit.log.1 …, oldest first: every change made through the agent —
    who, what, which capsule, from where, the result, refusals included (a refusal repeated is one line, then
    one saying how many more times and between when) — and every local change made with this command."""
    json_flag(json)
    store = open_store()
    rows = list(auditlog.entries(store.home, since=auditlog.parse_since(since) if since else None, user=user))

    def human() -> None:
        if not rows:
            console.print("no entries")
            return
        t = Table("time", "who", "action", "capsule", "from", "result")
        for r in rows:
            if "damaged" in r:
                t.add_row("?", "?", f"damaged line: {escape(r['damaged'])}", "", "", "")
                continue
            res = auditlog.describe(r)
            t.add_row(_when(r.get("time")), *(escape(str(r.get(k) or "-")) for k in ("who", "action", "capsule",
                                                                                     "from")),
                      "ok" if res == "ok" else f"[red]{escape(res)}[/]")
        console.print(t)

    emit(rows, human)


def register(root: typer.Typer) -> None:
    root.add_typer(user_app, name="user", help="Users and their roles: add, ls, rm, passwd.",
                   rich_help_panel=grammar.USERS)
    root.add_typer(token_app, name="token", help="API tokens of users: create, ls, revoke.",
                   rich_help_panel=grammar.USERS)
    root.command("chown", rich_help_panel=grammar.USERS)(chown)
    root.command("audit", rich_help_panel=grammar.USERS)(audit)
