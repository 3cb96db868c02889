"""The audit log: ``STORE/audit.log``, one JSON line per state-changing call, appended, never rewritten.

Each line: ``time`` (Unix seconds), ``iso`` (UTC), ``via`` (``agent`` or ``cli``), ``who`` (a user, ``USER/TOKEN``,
``host-token``, or for the CLI ``unix:NAME``), ``action`` (the route, or the command), ``capsule`` (if one),
``from`` (the client's address; ``local`` for the CLI) and ``result`` (``ok`` or the error's wire code). The file
is opened with ``O_APPEND`` (mode 0600) and each line is written with one ``write``, so lines of concurrent
writers never interleave. The agent writes it for every change (``capsule.agent.authz``), the CLI for its
local changes (``capsule.cli.main``); ``capsule audit`` reads it."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from capsule.errors import InvalidName

FILE = "audit.log"
MAX_FIELD = 200
_AGO = re.compile(r"([0-9]{1,9})([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _clip(value: Any) -> Any:
    return value[:MAX_FIELD] if isinstance(value, str) else value


def record(home: Path, *, who: str, action: str, capsule: str | None = None, remote: str | None = None,
           result: str = "ok", via: str = "agent", now: float | None = None) -> None:
    """Append one line. A failure to write is not hidden: it raises (the caller's answer is already out)."""
    t = time.time() if now is None else now
    line = json.dumps({"time": round(t, 3), "iso": datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds"),
                       "via": via, "who": _clip(who), "action": _clip(action), "capsule": _clip(capsule),
                       "from": _clip(remote), "result": _clip(result)}, ensure_ascii=True) + "\n"
    fd = os.open(Path(home) / FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def parse_since(text: str, now: float | None = None) -> float:
    """``30m``, ``1h``, ``2d``, ``1w`` (ago) or an ISO date/time (UTC unless it says) → Unix seconds."""
    m = _AGO.fullmatch(text.strip())
    if m:
        return (time.time() if now is None else now) - int(m[1]) * _UNITS[m[2]]
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidName(f"--since {text[:40]!r}: give an age (30m, 1h, 2d, 1w) or an ISO time "
                          "(2026-01-31 or 2026-01-31T12:00)") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


def entries(home: Path, *, since: float | None = None, user: str | None = None) -> Iterator[dict[str, Any]]:
    """The log's lines as dicts, oldest first (a damaged line is yielded as ``{"damaged": text}``)."""
    path = Path(home) / FILE
    if not path.exists():
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            try:
                e = json.loads(raw)
                if not isinstance(e, dict):
                    raise ValueError
            except ValueError:
                yield {"damaged": raw.rstrip("\n")[:MAX_FIELD]}
                continue
            if since is not None and float(e.get("time", 0)) < since:
                continue
            who = str(e.get("who", ""))
            if user is not None and who != user and not who.startswith(f"{user}/"):
                continue
            yield e
