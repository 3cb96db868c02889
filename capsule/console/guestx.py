"""A running capsule's X session, reached through Capsule's own guest agent (the virtio-serial channel every
capsule has): the X helper (``xsession.py``) is run in the guest by ``python3 -``, its source on stdin, through the
agent's ``exec``. Nothing is installed in the guest and nothing is added to the machine. Used by the clipboard
(``clipboard.py``), the screen's size (``screensize.py``) and the pointer (``pointer.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capsule.console.screen import running_instance
from capsule.errors import Conflict, GuestTimeout
from capsule.runtime.guestagent import AgentError, GuestAgent, exec_result
from capsule.store import Store

HELPER = (Path(__file__).with_name("xsession.py")).read_text()
EXEC_TIMEOUT = 15.0
AGENT_TIMEOUT = 10.0
TOO_LARGE, NO_SESSION, NO_ANSWER = 3, 4, 5     # the helper's exit codes


def agent(store: Store, name: str, what: str) -> GuestAgent:
    """A connection to the running capsule ``name``'s guest agent. NotFound for an unknown capsule, Conflict when
    it is not running (``what``: what it is wanted for), AgentUnavailable when nothing answers there."""
    inst = running_instance(store, name, what)
    return GuestAgent(Path(inst.dir) / "agent.sock", timeout=AGENT_TIMEOUT)


def run(agent: GuestAgent, name: str, what: str, argv: list[str], stdin: str | None = None,
        max_output: int = 64 * 1024) -> dict[str, Any]:
    """``argv`` run in the guest; its exec result. Conflict when the agent cannot run it, GuestTimeout past
    :data:`EXEC_TIMEOUT`."""
    args: dict[str, Any] = {"argv": argv, "timeout_s": EXEC_TIMEOUT, "max_output_bytes": max_output}
    if stdin is not None:
        args["stdin"] = stdin
    try:
        r = exec_result(agent.call("exec", args, timeout=EXEC_TIMEOUT + 5), f"capsule {name!r}: {what}")
    except AgentError as exc:
        raise Conflict(f"capsule {name!r} cannot reach its {what}: {exc} (this needs python3 and an X session "
                       "in the guest, as the desktop image has)") from exc
    if r["timed_out"]:
        raise GuestTimeout(f"capsule {name!r}: the {what} helper did not finish in {EXEC_TIMEOUT:.0f} s")
    return r


def helper(agent: GuestAgent, name: str, what: str, *args: str, max_output: int = 64 * 1024) -> dict[str, Any]:
    """The X helper run in the guest with ``args`` (``python3 - ARGS``, its source on stdin)."""
    return run(agent, name, what, ["python3", "-", *args], stdin=HELPER, max_output=max_output)


def failed(name: str, what: str, r: dict[str, Any]) -> Conflict:
    """The error of a helper that failed: its last line on stderr."""
    why = r["stderr"].strip().splitlines()[-1:] or [f"exit code {r['exit_code']}"]
    return Conflict(f"capsule {name!r} has no {what} to reach: {why[0][:300]}")
