"""``capsule ARGS`` in-process through typer's CliRunner: stdout and stderr apart, the global options reset
between calls (they live in a module object), the error raised kept as ``result.exception``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

TIMING = frozenset({"seconds", "commit_seconds"})


def invoke(home: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    from capsule.cli.common import OPTIONS
    from capsule.cli.main import app

    OPTIONS.json, OPTIONS.home = False, None
    return CliRunner().invoke(app, ["--home", str(home), *args], env=env)


def json_out(result: Any, drop: frozenset[str] = TIMING) -> Any:
    """The JSON a command printed on stdout (all of stdout must be that JSON), without the keys in ``drop``."""
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in drop}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return strip(json.loads(result.stdout))


def warned(result: Any) -> list[str]:
    """The deprecation warnings a command printed (on stderr; none may reach stdout)."""
    assert "deprecated" not in result.stdout
    return [line for line in result.stderr.splitlines() if line.startswith("warning:") and "deprecated" in line]
