"""The CLI keeps one grammar (capsule/cli/grammar.py): walked command by command, no option has a retired name,
every --to/--from/--on says what place it takes, a version is never an option value of its own, --help is
grouped by task, and every verb means one thing (the table of verbs says which, and where it is used)."""

from __future__ import annotations

import re

import pytest
import typer

from capsule.cli import grammar

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _walk(cmd, path):
    """(path, command, is_group) of every visible command under ``cmd``."""
    if hasattr(cmd, "list_commands"):
        ctx = typer.Context(cmd, info_name=path[-1] if path else "capsule")
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield [*path, name], sub, hasattr(sub, "list_commands")
                yield from _walk(sub, [*path, name])


def _commands():
    from capsule.cli.main import app

    return list(_walk(typer.main.get_command(app), []))


def _options(cmd):
    return [p for p in cmd.params if p.param_type_name == "option" and not p.hidden]


def test_no_option_has_a_retired_name():
    bad = [f"capsule {' '.join(path)} {name}: use {grammar.RENAMED[name]}"
           for path, cmd, _group in _commands() for p in _options(cmd) for name in p.opts if name in grammar.RENAMED]
    assert not bad, bad


def test_every_place_says_what_it_takes():
    """--to/--from/--on take a host's name or URL; in pod commands --to takes a capsule."""
    bad = []
    for path, cmd, _group in _commands():
        for p in _options(cmd):
            place = next((n for n in p.opts if n in grammar.PLACES), None)
            if place is None:
                continue
            text = (p.help or "").lower()
            wants = ("capsule",) if path[0] == "pod" and place == "--to" else ("host", "url")
            if not all(w in text for w in wants):
                bad.append(f"capsule {' '.join(path)} {place}: its help must say it takes a {' or '.join(wants)}")
    assert not bad, bad


def test_a_version_is_never_an_option_value_of_its_own():
    """A version is NAME@V where the capsule is named, never `--to @3`."""
    lone = re.compile(r"(?<![A-Za-z\]])@V\b")
    bad = [f"capsule {' '.join(path)} {p.opts[0]}" for path, cmd, _group in _commands() for p in _options(cmd)
           if lone.search(p.help or "")]
    assert not bad, f"options that take a bare @V (take NAME@V as the argument instead): {bad}"


def _panel(cmd) -> str | None:
    panel = getattr(cmd, "rich_help_panel", None)
    return panel if isinstance(panel, str) and panel else None     # unset: typer's DefaultPlaceholder


def test_help_is_grouped_by_task():
    """At the top level every command is in one of grammar.PANELS; in a large group each has a panel."""
    commands = _commands()
    bad = [f"capsule {path[0]}: panel {_panel(cmd)!r}" for path, cmd, _g in commands
           if len(path) == 1 and _panel(cmd) not in grammar.PANELS]
    for path, _cmd, group in commands:
        subs = [(p, c) for p, c, _g in commands if len(p) == len(path) + 1 and p[:len(path)] == path]
        if group and len(subs) >= grammar.PANEL_MIN:
            bad += [f"capsule {' '.join(p)}: no help panel" for p, c in subs if _panel(c) is None]
    assert not bad, bad
    assert {_panel(c) for p, c, _g in commands if len(p) == 1} == set(grammar.PANELS)


def test_each_verb_means_one_thing():
    """Every command's verb is in the table of verbs, used only in the groups the table names for it: a capsule
    is suspended (saved and stopped), a pod is frozen in place."""
    bad = []
    used: set[str] = set()
    for path, _cmd, group in _commands():
        verb, where = path[-1], (path[0] if len(path) > 1 else grammar.TOP)
        if group:
            if verb not in grammar.GROUPS:
                bad.append(f"capsule {' '.join(path)}: a group not in grammar.GROUPS")
            continue
        used.add(verb)
        if verb not in grammar.VERBS:
            bad.append(f"capsule {' '.join(path)}: the verb {verb!r} is not in grammar.VERBS (say what it means)")
        elif where not in grammar.VERBS[verb][1]:
            bad.append(f"capsule {' '.join(path)}: {verb!r} means {grammar.VERBS[verb][0]!r}, which is not what it "
                       f"does in {where or 'the top level'}")
    assert not bad, bad
    assert set(grammar.VERBS) == used, f"verbs in the table no command uses: {set(grammar.VERBS) - used}"
