"""The accounts commands are thin shells with clear refusals (exit codes of the error classes), a token is printed
once and works, and a local change made with the CLI leaves its audit line (who: the unix user) while a look
leaves none."""

from __future__ import annotations

import io
import json
import sys

import pytest

from capsule import audit
from capsule.accounts import tokens, users
from capsule.cli import main as cli_main
from capsule.cli.audited import command_of
from capsule.cli.common import OPTIONS
from capsule.store import Store

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Result:
    def __init__(self, exit_code: int, output: str) -> None:
        self.exit_code, self.output = exit_code, output


@pytest.fixture
def run(capsys, monkeypatch):
    """``capsule ARGS`` through ``capsule.cli.main.main`` (the audited entry point, errors mapped once)."""
    def call(home, *args: str, input: str | None = None) -> Result:  # noqa: A002 - as CliRunner names it
        OPTIONS.json, OPTIONS.home = False, None
        monkeypatch.setattr(sys, "argv", ["capsule", "--home", str(home), *args])
        monkeypatch.setattr(sys, "stdin", io.StringIO(input or ""))
        code = 0
        try:
            cli_main.main()
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return Result(code, out.out + out.err)

    return call


@pytest.fixture
def home(tmp_path):
    Store.open(tmp_path / "s").close()
    return tmp_path / "s"


def test_users_and_tokens_from_the_command_line(home, run):
    r = run(home, "user", "add", "alice", "--role", "owner", "--password-stdin", input="long enough pw\n")
    assert r.exit_code == 0, r.output
    r = run(home, "user", "add", "Bad Name", "--role", "owner", "--no-password")
    assert r.exit_code == 2 and "user name" in r.output
    r = run(home, "user", "add", "carol", "--role", "owner", "--password-stdin", input="short\n")
    assert r.exit_code == 2 and "8 to 1024" in r.output
    r = run(home, "--json", "token", "create", "--user", "alice", "--scope", "read", "--scope", "capsules",
            "--expires", "30d")
    assert r.exit_code == 0, r.output
    made = json.loads(r.output[r.output.index("{"):])
    assert made["scopes"] == ["capsules", "read"] and made["token"].startswith("cap_")
    store = Store.open(home)
    assert tokens.resolve(store, made["token"], None).user == "alice"
    r = run(home, "--json", "token", "ls")
    assert made["token"] not in r.output and made["id"] in r.output
    assert run(home, "token", "create", "--user", "alice", "--scope", "host").exit_code == 2
    assert run(home, "token", "revoke", made["id"]).exit_code == 0
    assert tokens.get(store, made["id"]).state() == "revoked"
    assert run(home, "user", "rm", "nobody").exit_code == 3
    assert [u.name for u in users.users(store)] == ["alice"]
    store.close()


def test_local_changes_are_audited_and_looks_are_not(home, run):
    run(home, "user", "add", "bob", "--role", "operator", "--no-password")
    run(home, "user", "ls")
    run(home, "token", "create", "--user", "bob", "--scope", "everything")
    run(home, "audit")
    got = [(e["who"].startswith("unix:"), e["via"], e["action"], e["result"]) for e in audit.entries(home)]
    assert got == [(True, "cli", "capsule user add bob", "ok"), (True, "cli", "capsule token create", "invalid_name")]
    who = next(audit.entries(home))["who"]
    r = run(home, "--json", "audit", "--user", who, "--since", "1h")
    assert [e["action"] for e in json.loads(r.output)] == ["capsule user add bob", "capsule token create"]
    assert len(list(audit.entries(home))) == 2          # reading the log is no change


def test_command_words():
    assert command_of(["--home", "x", "user", "add", "alice", "--role", "owner"]) == (["user", "add", "alice"], None)
    assert command_of(["--json", "start", "demo", "--timeout", "3"]) == (["start"], "demo")
    assert command_of(["migrate", "--to", "office", "demo"]) == (["migrate"], None)
