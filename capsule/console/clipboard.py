"""A running capsule's clipboard, both ways, through Capsule's own guest agent (the virtio-serial channel every
capsule has): :func:`get` reads the guest's X clipboard, :func:`set` makes a text the guest's clipboard.

The guest side is a small X selection helper (``xclip.py``) run by ``python3 -`` (its source on stdin) through
the agent's ``exec``; nothing is installed in the guest, and nothing is added to the machine: QEMU's own clipboard path
(the ``qemu-vdagent`` chardev) carries a migration blocker, so a capsule with it could no longer move. The
selection lives in a guest process, so it moves with the capsule (live, or in a memory image).

A text is at most :data:`MAX_BYTES` bytes of UTF-8, both ways; beyond that :class:`RequestTooLarge`, and nothing
changes in the guest."""

from __future__ import annotations

import base64
import binascii
import secrets
from pathlib import Path
from typing import Any

from capsule.console.screen import running_instance
from capsule.errors import Conflict, GuestTimeout, RequestTooLarge
from capsule.runtime.guestagent import AgentError, GuestAgent, exec_result
from capsule.store import Store

MAX_BYTES = 512 * 1024
"""The largest clipboard text, in bytes of UTF-8, either way: well below the agent's request body bound (1 MiB by
default), so the clipboard's own error is the one a caller sees."""

HELPER = (Path(__file__).with_name("xclip.py")).read_text()
INBOX = "/run/capsule-clipboard"     # root's, in the guest: where a text being set is written first
CHUNK = 48 * 1024                    # base64 characters an exec carries (the agent's request line: 64 KiB)
EXEC_TIMEOUT = 15.0
AGENT_TIMEOUT = 10.0
TOO_LARGE, NO_SESSION, NO_ANSWER = 3, 4, 5     # the helper's exit codes


def _too_large(size: int | None, where: str) -> RequestTooLarge:
    got = "" if size is None else f" ({size} bytes)"
    return RequestTooLarge(f"{where}{got} is larger than the clipboard's limit of {MAX_BYTES // 1024} KiB: "
                           "copy a smaller part")


def _run(agent: GuestAgent, name: str, argv: list[str], stdin: str | None = None,
         max_output: int = 64 * 1024) -> dict[str, Any]:
    args: dict[str, Any] = {"argv": argv, "timeout_s": EXEC_TIMEOUT, "max_output_bytes": max_output}
    if stdin is not None:
        args["stdin"] = stdin
    try:
        r = exec_result(agent.call("exec", args, timeout=EXEC_TIMEOUT + 5), f"capsule {name!r}: clipboard")
    except AgentError as exc:
        raise Conflict(f"capsule {name!r} cannot reach its clipboard: {exc} (the clipboard needs python3 "
                       "and an X session in the guest, as the desktop image has)") from exc
    if r["timed_out"]:
        raise GuestTimeout(f"capsule {name!r}: the clipboard helper did not finish in {EXEC_TIMEOUT:.0f} s")
    return r


def _failed(name: str, r: dict[str, Any]) -> Conflict:
    why = r["stderr"].strip().splitlines()[-1:] or [f"exit code {r['exit_code']}"]
    return Conflict(f"capsule {name!r} has no clipboard to reach: {why[0][:300]}")


def _agent(store: Store, name: str) -> GuestAgent:
    inst = running_instance(store, name, "clipboard")
    return GuestAgent(Path(inst.dir) / "agent.sock", timeout=AGENT_TIMEOUT)


def get(store: Store, name: str) -> str:
    """The running capsule ``name``'s clipboard text (empty when nothing in the guest owns one). NotFound for an
    unknown capsule, Conflict when it is not running or has no X session, RequestTooLarge over
    :data:`MAX_BYTES`, GuestAgent errors (503/502) when its agent does not answer."""
    with _agent(store, name) as agent:
        r = _run(agent, name, ["python3", "-", "get", str(MAX_BYTES)], stdin=HELPER,
                 max_output=4 * (MAX_BYTES // 3 + 1) + 64)
    if r["exit_code"] == TOO_LARGE:
        raise _too_large(None, f"capsule {name!r}'s clipboard")
    if r["exit_code"] != 0:
        raise _failed(name, r)
    try:
        data = base64.b64decode(r["stdout"].strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise Conflict(f"capsule {name!r}: the clipboard helper answered something other than base64") from exc
    if len(data) > MAX_BYTES:
        raise _too_large(len(data), f"capsule {name!r}'s clipboard")
    return data.decode("utf-8", errors="replace")


def set(store: Store, name: str, text: str) -> int:
    """Make ``text`` the running capsule ``name``'s clipboard (CLIPBOARD and PRIMARY: a terminal pastes it with
    its middle button or Shift+Insert); the number of bytes set. Errors as :func:`get`; a text over
    :data:`MAX_BYTES` is refused before anything reaches the guest."""
    data = text.encode("utf-8", errors="replace")
    if len(data) > MAX_BYTES:
        raise _too_large(len(data), "the text")
    encoded = base64.b64encode(data).decode()
    inbox = f"{INBOX}/{secrets.token_hex(8)}"
    with _agent(store, name) as agent:
        for i in range(0, max(len(encoded), 1), CHUNK):
            write = "umask 077 && mkdir -p " + INBOX + " && cat > " if i == 0 else "cat >> "
            r = _run(agent, name, ["sh", "-c", write + inbox], stdin=encoded[i:i + CHUNK])
            if r["exit_code"] != 0:
                raise _failed(name, r)
        r = _run(agent, name, ["python3", "-", "set", inbox], stdin=HELPER)
        if r["exit_code"] != 0:
            _run(agent, name, ["rm", "-f", inbox])
            raise _failed(name, r)
    return len(data)
