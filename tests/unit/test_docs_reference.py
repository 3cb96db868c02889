"""The manual's generated chapters match the code, and the CLI documents itself: every option of every
command has help text, so `docs/cli.md` (generated from `--help`) has no empty row."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import typer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _commands(cmd, path):
    yield path, cmd
    if hasattr(cmd, "list_commands"):
        ctx = typer.Context(cmd, info_name=path[-1])
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _commands(sub, [*path, name])


def test_cli_reference_and_exit_codes_are_current():
    gen = _generator()
    assert (ROOT / "docs" / "cli.md").read_text() == gen.cli_reference(), \
        "docs/cli.md is stale: run `python scripts/gen_reference.py`"
    assert (ROOT / "docs" / "exit-codes.md").read_text() == gen.exit_codes(), \
        "docs/exit-codes.md is stale: run `python scripts/gen_reference.py`"


def test_every_command_and_option_has_help():
    from capsule.cli.main import app

    missing = []
    for path, cmd in _commands(typer.main.get_command(app), ["capsule"]):
        if not (cmd.help or cmd.short_help):
            missing.append(" ".join(path))
        for p in cmd.params:
            if p.param_type_name == "option" and not p.hidden and not (p.help or "").strip():
                missing.append(f"{' '.join(path)} {p.opts[0]}")
    assert not missing, f"without help text: {missing}"
