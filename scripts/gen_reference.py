"""Write the manual's reference chapters from the code itself, so they cannot drift from it.

- ``docs/cli.md``: every command of ``capsule``, its usage, help and options, walked from the Typer app;
- ``docs/exit-codes.md``: every exit code, from the error classes (their wire code and HTTP status too).

``python scripts/gen_reference.py`` writes both; ``--check`` only compares and exits 1 naming the stale file
(``make lint`` runs it, and ``tests/unit/test_docs_reference.py`` does the same in the unit tier)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path
from typing import Any

import typer

ROOT = Path(__file__).resolve().parent.parent
CLI_DOC = ROOT / "docs" / "cli.md"
EXIT_DOC = ROOT / "docs" / "exit-codes.md"


def _option_row(p: Any) -> str:
    names = ", ".join(f"`{n}`" for n in [*p.opts, *p.secondary_opts])
    help_text = " ".join((getattr(p, "help", None) or "").split()).replace("|", "\\|")
    default = ""
    if p.param_type_name == "option" and not p.is_flag and p.default not in (None, (), [], "") \
            and not callable(p.default) and p.show_default is not False:
        default = f" (default: `{p.default}`)"
    return f"| {names} | {help_text}{default} |"


def _command_md(cmd: Any, path: list[str], ctx: typer.Context) -> list[str]:
    out: list[str] = []
    title = " ".join(path)
    level = "#" * min(2 + len(path) - 1, 4)
    out.append(f"{level} `{title}`\n")
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    out.append(f"```text\n{title} {usage}\n```\n")
    if cmd.help:
        out.append(inspect.cleandoc(cmd.help).replace("\b\n", "") + "\n")
    args = [p for p in cmd.params if p.param_type_name == "argument"]
    opts = [p for p in cmd.params if p.param_type_name == "option" and not p.hidden and p.name != "help"]
    if args:
        out.append("Arguments: " + ", ".join(f"`{(a.metavar or a.name or '').upper()}`" for a in args) + "\n")
    if opts:
        out.append("| option | what it does |\n|---|---|")
        out.extend(_option_row(p) for p in opts)
        out.append("")
    if hasattr(cmd, "list_commands"):  # a group (Typer carries its own copy of click: no isinstance)
        for name in sorted(cmd.list_commands(ctx)):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            out.extend(_command_md(sub, [*path, name], typer.Context(sub, info_name=name, parent=ctx)))
    return out


def cli_reference() -> str:
    from capsule.cli.main import app

    root = typer.main.get_command(app)
    ctx = typer.Context(root, info_name="capsule")
    head = ["# CLI reference", "",
            "Generated from the CLI itself by `scripts/gen_reference.py` (`make lint` fails when it is stale):",
            "what `capsule COMMAND --help` prints, every command on one page. Every command takes `--help`;",
            "every command that prints takes the global `--json`. Exit codes: [Exit codes](exit-codes.md).", ""]
    return "\n".join(head + _command_md(root, ["capsule"], ctx)).rstrip() + "\n"


_PACKAGES = ("hashcache", "diskserver", "capsule")


def _load_error_classes() -> None:
    for pkg_name in _PACKAGES:
        pkg = importlib.import_module(pkg_name)
        for mod in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
            if mod.name.endswith("plugin") or ".imagebuild.files" in mod.name:
                continue
            try:
                importlib.import_module(mod.name)
            except Exception:  # noqa: BLE001 - a module that needs the host (libvirt …) adds no error class here
                continue


def exit_codes() -> str:
    from hashcache.errors import Error, registered

    _load_error_classes()
    by_exit: dict[int, list[type[Error]]] = {}
    for cls in registered().values():
        if cls.__module__.split(".")[0] not in _PACKAGES:
            continue  # a class a test (or a plugin) defined is no part of the product's reference
        by_exit.setdefault(cls.exit_code, []).append(cls)
    lines = ["# Exit codes", "",
             "Every error Capsule raises on purpose is a class with one root (`hashcache.errors.Error`); each",
             "carries its exit code (the CLI's), its HTTP status (the agent's answer) and its wire code (the",
             "`error` field of that answer, which a client turns back into the same class). Generated from",
             "those classes by `scripts/gen_reference.py`.", "",
             "| exit | wire code | HTTP | what it means |", "|---|---|---|---|"]
    for code in sorted(by_exit):
        for cls in sorted(by_exit[code], key=lambda c: c.code):
            own = inspect.cleandoc(cls.__dict__.get("__doc__") or "") or f"({cls.__name__})"
            doc = " ".join(own.split("\n\n")[0].split()).replace("|", "\\|")
            lines.append(f"| {code} | `{cls.code}` | {cls.http_status} | {doc} |")
    lines += ["", "0 is success; 1 a failure with no more precise class; 130 an interrupt (Ctrl-C) outside a",
              "cancellable step."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 when a chapter is stale")
    a = ap.parse_args()
    stale = []
    for path, text in ((CLI_DOC, cli_reference()), (EXIT_DOC, exit_codes())):
        if a.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.relative_to(ROOT))
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(map(str, stale))}: run `python scripts/gen_reference.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
