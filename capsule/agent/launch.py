"""Starting a host agent (``capsule serve``) as a child process and waiting until it answers: the one
way tests, benchmarks and the demo run an agent.

    with AgentProcess(home, home / "agent.token") as agent:
        transfer.push(store, "cap", agent.url, agent.token)

The agent runs in its own session (stopping it stops everything it started), writes its log to a file
(a pipe nobody reads would stall it once full), and is ready when ``/v1/info`` answers with its token
(``capsule serve`` creates the token file if it is missing). Importing this module does not import the
agent's web framework."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from capsule.errors import Unreachable

START_TIMEOUT = 60.0


def serve_command(home: Path, listen: str, token_file: Path) -> list[str]:
    """The command line of ``capsule serve`` for a store, an address and a token file."""
    return [sys.executable, "-m", "capsule.cli.main", "--home", str(home), "serve", "--listen", listen,
            "--token-file", str(token_file)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class AgentProcess:
    """``capsule serve`` for the store at ``home`` on ``host:port`` (a free port if none is given)."""

    def __init__(self, home: Path, token_file: Path, port: int | None = None, *, host: str = "127.0.0.1",
                 log_path: Path | None = None, timeout: float = START_TIMEOUT,
                 env: Mapping[str, str] | None = None) -> None:
        self.home = Path(home)
        self.token_file = Path(token_file)
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path or self.token_file.with_suffix(".log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(serve_command(self.home, f"{host}:{self.port}", self.token_file),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                         start_new_session=True, env=None if env is None else dict(env))
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        """Everything the agent wrote to its log so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.token_file.exists():
                with contextlib.suppress(httpx.TransportError):
                    r = httpx.get(f"{self.url}/v1/info", headers={"Authorization": f"Bearer {self.token}"},
                                  timeout=5.0)
                    if r.status_code == 200:
                        return
            if self.proc.poll() is not None:
                raise Unreachable(f"the agent for {self.home} exited with status {self.proc.returncode} "
                                  f"before answering: {self.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise Unreachable(f"the agent for {self.home} did not answer on {self.url} within {timeout:.0f}s: "
                                  f"{self.log()[-2000:]}")
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the agent and everything it started (SIGTERM, then SIGKILL after ``timeout``)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
