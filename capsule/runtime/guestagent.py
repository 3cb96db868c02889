"""The host side of the guest agent (guest-balloon/PROTOCOL.md): JSON lines
over the virtio-serial channel libvirt exposes as a unix socket.

Every call has a deadline and never hangs the caller: a guest without an
agent, an agent that does not answer, or one that sends garbage or endless
lines gives ``AgentUnavailable`` (or ``AgentError`` for an error reply).

What a guest answers is read through :class:`Reply`: a field missing, of the wrong type or outside the range
the host expects raises ``AgentReplyInvalid`` (an ``AgentError``) naming it, never a ValueError, TypeError or
KeyError (:func:`exec_result` for ``exec``)."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import reprlib
import socket
import time
from pathlib import Path
from typing import Any

from capsule.errors import CapsuleError
from capsule.runtime import guestfiles
from hashcache import wirejson

MAX_REPLY = 16 << 20       # a reply line longer than this is refused
CONNECT_TIMEOUT = 2.0
SYNC_ATTEMPT = 2.0         # how long one ping confirming a fresh connection is waited on before it is resent


class AgentUnavailable(CapsuleError):
    """No guest agent answered (none installed, not started yet, or misbehaving)."""

    code = "guest_agent_unavailable"
    exit_code = 14
    http_status = 503


class AgentNoAnswer(AgentUnavailable):
    """The deadline passed with no reply (the channel itself is fine)."""


class AgentError(CapsuleError):
    """The guest agent answered with an error."""

    code = "guest_agent_error"
    exit_code = 14
    http_status = 502


class AgentReplyInvalid(AgentError):
    """The guest answered with a reply of the wrong shape: a field missing, of the wrong type, or outside what
    the host asked for (a size over the cap, a path it did not ask about)."""

    code = "guest_agent_reply_invalid"


_REQUIRED: Any = object()
MAX_INT = (1 << 63) - 1


_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 3, 60, 60, 40


def _show(value: object) -> str:
    """A short rendering of what the guest sent, for a message (bounded whatever its size or depth)."""
    return _SHOW.repr(value)


class Reply:
    """The result of one guest reply, read field by field. Each reader takes the field's ``key``, its bounds and
    a ``default`` for a field that may be missing (a required field has none); a field missing, of the wrong
    type or out of bounds raises :class:`AgentReplyInvalid` naming ``what`` answered and the field."""

    def __init__(self, value: object, what: str) -> None:
        if not isinstance(value, dict):
            raise AgentReplyInvalid(f"{what}: the guest answered {_show(value)}, not a JSON object")
        self.value: dict[str, Any] = value
        self.what = what

    def invalid(self, key: str, want: str) -> AgentReplyInvalid:
        """The error for field ``key``, which should have been ``want``."""
        return AgentReplyInvalid(f"{self.what}: the guest's {key!r} should be {want}, not {_show(self.value.get(key))}")

    def _get(self, key: str, default: object, want: str) -> tuple[bool, Any]:
        """(present, value): a missing field is its default, or an error when it has none."""
        if key in self.value:
            return True, self.value[key]
        if default is _REQUIRED:
            raise AgentReplyInvalid(f"{self.what}: the guest's reply has no {key!r} (it should be {want})")
        return False, default

    def integer(self, key: str, lo: int = 0, hi: int = MAX_INT, default: Any = _REQUIRED,
                nullable: bool = False) -> Any:
        """A whole number in [lo, hi] (a float with no fraction counts); null only where ``nullable``."""
        want = f"a whole number from {lo} to {hi}" + (" or null" if nullable else "")
        present, v = self._get(key, default, want)
        if not present or v is None and nullable:
            return v
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.invalid(key, want)
        return v

    def number(self, key: str, lo: float = 0.0, hi: float = 1e12, default: Any = _REQUIRED) -> Any:
        want = f"a number from {lo:g} to {hi:g}"
        present, v = self._get(key, default, want)
        if present and (isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi):  # NaN fails
            raise self.invalid(key, want)
        return v

    def text(self, key: str, max_len: int = 4096, pattern: re.Pattern[str] | None = None,
             default: Any = _REQUIRED, nullable: bool = False) -> Any:
        want = (f"text matching {pattern.pattern}" if pattern else f"text of at most {max_len} characters") \
            + (" or null" if nullable else "")
        present, v = self._get(key, default, want)
        if not present or v is None and nullable:
            return v
        if not isinstance(v, str) or len(v) > max_len or pattern is not None and not pattern.fullmatch(v):
            raise self.invalid(key, want)
        return v

    def flag(self, key: str, default: Any = _REQUIRED) -> Any:
        present, v = self._get(key, default, "true or false")
        if present and not isinstance(v, bool):
            raise self.invalid(key, "true or false")
        return v


def exec_result(value: object, what: str = "exec") -> dict[str, Any]:
    """An ``exec`` result (PROTOCOL.md), checked: ``exit_code`` and ``signal`` whole numbers or null,
    ``timed_out`` a flag, ``stdout`` and ``stderr`` text (missing: empty)."""
    r = Reply(value, what)
    return {"exit_code": r.integer("exit_code", -(1 << 31), (1 << 31) - 1, default=None, nullable=True),
            "signal": r.integer("signal", 0, 255, default=None, nullable=True),
            "timed_out": r.flag("timed_out", default=False),
            "stdout": r.text("stdout", MAX_REPLY, default=""),
            "stderr": r.text("stderr", MAX_REPLY, default="")}


def _connect(path: Path) -> socket.socket:
    """A connection to the guest agent socket at ``path``. libvirt makes it root's (mode 0775): a process that
    gave up root for the store's owner (``capsule serve --user``) is refused, and asks its root helper instead."""
    try:
        return guestfiles.connect_socket(path, "the guest agent's socket", CONNECT_TIMEOUT, root_too=True)
    except PermissionError:
        from capsule import privsep

        if isinstance(privsep.current(), privsep.Direct):
            raise
        try:
            return privsep.current().connect_agent(path, CONNECT_TIMEOUT)
        except CapsuleError as exc:    # not listening yet, or not running: as a refused connect would say
            raise ConnectionError(str(exc)) from exc


class GuestAgent:
    """One connection to a guest's agent socket."""

    def __init__(self, sock_path: Path, timeout: float = 5.0) -> None:
        self.path = sock_path
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._buf = b""
        self._synced = False  # a reply has come on this connection: the agent reads it
        try:  # libvirt makes the channel's socket (root's); never through a link QEMU may have put in its place
            self._sock = _connect(Path(sock_path))
        except OSError as exc:
            raise AgentUnavailable(f"no guest agent channel at {sock_path}: {exc.strerror or exc}") from exc
        self._send(b"\n")  # ends any partial line a previous host left behind

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> GuestAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, data: bytes) -> None:
        try:
            self._sock.settimeout(self.timeout)
            self._sock.sendall(data)
        except OSError as exc:
            raise AgentUnavailable(f"writing to the guest agent failed: {exc}") from exc

    def _line(self, deadline: float) -> bytes:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentNoAnswer("the guest agent did not answer in time")
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(1 << 16)
            except TimeoutError as exc:
                raise AgentNoAnswer("the guest agent did not answer in time") from exc
            except OSError as exc:
                raise AgentUnavailable(f"reading from the guest agent failed: {exc}") from exc
            if not chunk:
                raise AgentUnavailable("the guest agent channel closed")
            self._buf += chunk
            if len(self._buf) > MAX_REPLY and b"\n" not in self._buf:
                self._buf = b""
                raise AgentUnavailable(f"the guest agent sent a line longer than {MAX_REPLY} bytes")
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def call(self, cmd: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Send one request and wait for its reply (lines that do not parse, or
        answer another id, are skipped). The first request on a connection other
        than a ping is preceded by pings until one is answered (``_sync``)."""
        wait = timeout if timeout is not None else self.timeout
        if cmd != "ping" and not self._synced:
            self._sync(time.monotonic() + wait)
        return self._request(cmd, args, wait)

    def _sync(self, deadline: float) -> None:
        """Confirm a fresh connection before a request that may be waited on for minutes. The agent
        notices a host by polling, and a request that lands as it reopens a silent port is discarded by
        the guest kernel with the port's unread data (PROTOCOL.md): a lost ping is resent after
        ``SYNC_ATTEMPT`` seconds, where a lost ``exec`` would be waited on to its deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentNoAnswer("the guest agent did not answer in time")
            try:
                self._request("ping", None, min(SYNC_ATTEMPT, left))
                return
            except AgentNoAnswer:
                continue

    def _request(self, cmd: str, args: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        rid = next(self._ids)
        self._send(json.dumps({"id": rid, "cmd": cmd, "args": args or {}}).encode() + b"\n")
        deadline = time.monotonic() + timeout
        while True:
            line = self._line(deadline).strip()
            if not line:
                continue
            try:
                reply = wirejson.loads(line)
            except ValueError:
                continue
            if not isinstance(reply, dict) or reply.get("id") != rid:
                continue
            self._synced = True
            if reply.get("ok") is True and isinstance(reply.get("result"), dict):
                return reply["result"]
            raise AgentError(f"guest agent: {cmd}: {reply.get('error', 'malformed reply')}")

    # -- the commands ---------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return self.call("ping")

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def inflate(self, policy: str = "cache", timeout_s: float = 30.0, **limits: int) -> dict[str, Any]:
        args: dict[str, Any] = {"policy": policy, "timeout_s": timeout_s, **limits}
        return self.call("balloon.inflate", args, timeout=timeout_s + 5)

    def deflate(self) -> dict[str, Any]:
        return self.call("balloon.deflate")

    def status(self) -> dict[str, Any]:
        return self.call("balloon.status")

    def freeze(self, timeout_s: float = 30.0) -> dict[str, Any]:
        return self.call("fs.freeze", {"timeout_s": timeout_s}, timeout=timeout_s)

    def thaw(self) -> dict[str, Any]:
        return self.call("fs.thaw", timeout=30)

    def exec(self, argv: list[str], timeout_s: float = 30.0, stdin: str | None = None) -> dict[str, Any]:
        """Run ``argv`` in the guest; its result checked by :func:`exec_result`."""
        args: dict[str, Any] = {"argv": argv, "timeout_s": timeout_s}
        if stdin is not None:
            args["stdin"] = stdin
        return exec_result(self.call("exec", args, timeout=timeout_s + 3), f"exec {argv[0] if argv else ''}")


def wait_for_agent(sock_path: Path, timeout: float = 30.0) -> dict[str, Any]:
    """Ping until the agent answers (it may still be starting); returns the ping result."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with GuestAgent(sock_path, timeout=min(2.0, max(0.2, deadline - time.monotonic()))) as agent:
                return agent.ping()
        except AgentUnavailable as exc:
            last = exc
            time.sleep(0.3)
    raise AgentUnavailable(f"no guest agent answered within {timeout:.0f}s ({last})")
