"""The audit log: ``STORE/audit.log``, one JSON line per state-changing call, appended, never rewritten; rotated
at a size cap so it cannot fill the disk.

Each line: ``time`` (Unix seconds), ``iso`` (UTC), ``via`` (``agent`` or ``cli``), ``who`` (a user, ``USER/TOKEN``,
``host-token``, or for the CLI ``unix:NAME``), ``action`` (the route, or the command), ``capsule`` (if one),
``from`` (the client's address; ``local`` for the CLI) and ``result`` (``ok`` or the error's wire code). The agent
folds a refusal repeated within a few minutes (same who, action, capsule, address and result) into one *summary*
line written after it (``capsule.agent.auditlog``): it has ``repeated`` (how many more times), ``first`` and
``last`` (Unix seconds of the first and last of those), and ``time`` is ``last``.

Writing: under an exclusive ``fcntl`` lock on ``audit.log.lock`` (the agent and CLI commands write the same log),
the line is appended with one ``write`` to ``audit.log`` (``O_APPEND``, mode 0600); when that would take the file
past :attr:`Rotation.max_bytes`, it is first renamed to ``audit.log.1`` (``.1`` to ``.2`` …, the oldest beyond
:attr:`Rotation.keep` files in all removed). ``CAPSULE_AUDIT_MAX_SIZE`` (e.g. ``16M``, the default) and
``CAPSULE_AUDIT_KEEP`` (files kept, the current one included; default 4) set them, for the agent and the CLI alike.

Reading (:func:`entries`, ``capsule audit``) goes through the rotated files, oldest first, then ``audit.log``."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from capsule.errors import InvalidName
from capsule.units import human, parse_size

FILE = "audit.log"
LOCK = FILE + ".lock"
MAX_FIELD = 200
MAX_BYTES = 16 << 20
KEEP = 4
ENV_MAX_SIZE = "CAPSULE_AUDIT_MAX_SIZE"
ENV_KEEP = "CAPSULE_AUDIT_KEEP"
MIN_BYTES = 4096           # a few lines at least: a line is at most about 1.5 KiB
_AGO = re.compile(r"([0-9]{1,9})([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_ROTATED = re.compile(re.escape(FILE) + r"\.([0-9]{1,4})")


@dataclass(frozen=True)
class Rotation:
    """When the log is rotated (``max_bytes``) and how many files are kept, ``audit.log`` included (``keep``)."""

    max_bytes: int = MAX_BYTES
    keep: int = KEEP

    def __post_init__(self) -> None:
        if not MIN_BYTES <= self.max_bytes <= 1 << 40:
            raise InvalidName(f"{ENV_MAX_SIZE}: the audit log's size cap must be between {human(MIN_BYTES)} and "
                              f"1 TiB (e.g. 16M); got {self.max_bytes} bytes")
        if not 2 <= self.keep <= 1000:
            raise InvalidName(f"{ENV_KEEP}: keep between 2 and 1000 audit log files (the current one included); "
                              f"got {self.keep}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Rotation:
        """The rotation ``CAPSULE_AUDIT_MAX_SIZE`` and ``CAPSULE_AUDIT_KEEP`` ask for (defaults where unset);
        :class:`InvalidName` for a value that is not a size / a whole number in range."""
        env = os.environ if env is None else env
        size, keep = env.get(ENV_MAX_SIZE, "").strip(), env.get(ENV_KEEP, "").strip()
        try:
            max_bytes = parse_size(size) if size else MAX_BYTES
        except InvalidName:
            raise InvalidName(f"{ENV_MAX_SIZE}={size[:40]!r}: give a size such as 16M or 1G") from None
        if keep and not keep.isdecimal():
            raise InvalidName(f"{ENV_KEEP}={keep[:40]!r}: give a whole number of files, e.g. 4")
        return cls(max_bytes, int(keep) if keep else KEEP)


def _clip(value: Any) -> Any:
    return value[:MAX_FIELD] if isinstance(value, str) else value


def line(*, who: str, action: str, capsule: str | None = None, remote: str | None = None, result: str = "ok",
         via: str = "agent", now: float | None = None, **more: Any) -> dict[str, Any]:
    """One entry as written (fields clipped); ``more``: the summary fields (``repeated``, ``first``, ``last``)."""
    t = time.time() if now is None else now
    return {"time": round(t, 3), "iso": datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds"),
            "via": via, "who": _clip(who), "action": _clip(action), "capsule": _clip(capsule),
            "from": _clip(remote), "result": _clip(result), **more}


def record(home: Path, *, who: str, action: str, capsule: str | None = None, remote: str | None = None,
           result: str = "ok", via: str = "agent", now: float | None = None,
           rotation: Rotation | None = None) -> None:
    """Append one line. A failure to write is not hidden: it raises (the caller's answer is already out)."""
    append(home, [line(who=who, action=action, capsule=capsule, remote=remote, result=result, via=via, now=now)],
           rotation)


def append(home: Path, entries: list[dict[str, Any]], rotation: Rotation | None = None) -> None:
    """Append ``entries`` in order, each line with one ``write``, rotating first whenever a line would pass the
    size cap — all under the log's lock, so two writers neither interleave nor rotate twice."""
    if not entries:
        return
    rotation = rotation or Rotation.from_env()
    home = Path(home)
    with _locked(home, fcntl.LOCK_EX):
        fd = _open_log(home)
        try:
            for entry in entries:
                data = (json.dumps(entry, ensure_ascii=True) + "\n").encode()
                size = os.fstat(fd).st_size
                if size and size + len(data) > rotation.max_bytes:
                    os.close(fd)
                    fd = -1
                    _rotate(home, rotation.keep)
                    fd = _open_log(home)
                os.write(fd, data)
        finally:
            if fd >= 0:
                os.close(fd)


def _open_log(home: Path) -> int:
    return os.open(home / FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextlib.contextmanager
def _locked(home: Path, how: int) -> Iterator[None]:
    fd = os.open(home / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)      # (releases the lock)


def _rotate(home: Path, keep: int) -> None:
    """``audit.log`` → ``.1`` → ``.2`` …; files past ``keep - 1`` rotated ones removed (the caller holds the lock).
    Each step is a ``rename``: a reader sees every line in some file, never a half-moved one."""
    for n, path in sorted(_rotated(home), reverse=True):
        if n >= keep - 1:
            path.unlink(missing_ok=True)
        else:
            os.replace(path, home / f"{FILE}.{n + 1}")
    os.replace(home / FILE, home / f"{FILE}.1")


def _rotated(home: Path) -> list[tuple[int, Path]]:
    out = []
    with contextlib.suppress(FileNotFoundError):
        for p in home.iterdir():
            m = _ROTATED.fullmatch(p.name)
            if m:
                out.append((int(m[1]), p))
    return out


def files(home: Path) -> list[Path]:
    """The log's files, oldest first: ``audit.log.N`` … ``audit.log.1``, ``audit.log`` (those that exist)."""
    home = Path(home)
    out = [p for _, p in sorted(_rotated(home), reverse=True)]
    return out + ([home / FILE] if (home / FILE).exists() else [])


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


def _open_all(home: Path) -> list[Any]:
    """The log's files opened together under a shared lock (so no rotation moves lines between them meanwhile);
    read after the lock is let go. A reader who may not take the lock (a read-only store) opens them without."""
    home = Path(home)
    try:
        lock = os.open(home / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        lock = -1
    opened = []
    try:
        if lock >= 0:
            fcntl.flock(lock, fcntl.LOCK_SH)
        for p in files(home):
            with contextlib.suppress(FileNotFoundError):
                opened.append(open(p, encoding="utf-8", errors="replace"))  # noqa: SIM115 - closed by entries
    finally:
        if lock >= 0:
            os.close(lock)
    return opened


def entries(home: Path, *, since: float | None = None, user: str | None = None) -> Iterator[dict[str, Any]]:
    """The log's lines as dicts, oldest first, across its rotated files (a damaged line is yielded as
    ``{"damaged": text}``). A summary line counts as of its ``time`` (its last refusal)."""
    opened = _open_all(home)
    try:
        for f in opened:
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
    finally:
        for f in opened:
            f.close()


def describe(entry: dict[str, Any]) -> str:
    """An entry's result as a person reads it: ``ok``, the error's code, or for a summary line
    ``forbidden, 1,234 more times between 12:00:01 and 12:04:59 UTC``."""
    result = str(entry.get("result", ""))
    n = entry.get("repeated")
    if not isinstance(n, int) or n <= 0:
        return result

    def at(t: Any) -> str:
        try:
            return datetime.fromtimestamp(float(t), UTC).strftime("%Y-%m-%d %H:%M:%S")
        except (TypeError, ValueError, OverflowError):
            return "?"

    return f"{result}, {n:,} more time{'s' if n != 1 else ''} between {at(entry.get('first'))} and " \
           f"{at(entry.get('last'))} UTC"
