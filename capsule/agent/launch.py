"""Starting a host agent (``capsule serve``) as a child process and waiting until it answers: the one
way tests, benchmarks and the demo run an agent.

    with AgentProcess(home, home / "agent.token") as agent:
        transfer.push(store, "cap", agent.url, agent.token)

The agent runs in its own session (stopping it stops everything it started), writes its log to a file
(a pipe nobody reads would stall it once full), and is ready when ``/v1/info`` answers with its token
(``capsule serve`` creates the token file if it is missing).

With ``tls=True`` the agent listens with TLS on its own host key (made on its first start): ``url`` is
``https://…`` and ``fingerprint`` is its certificate's, which every client of it pins (read from the store's
certificate, as `capsule host add` would show it). Otherwise it runs with ``--insecure-http``, which
``capsule serve`` allows on loopback only. Importing this module does not import the agent's web framework."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from capsule.errors import Unreachable

START_TIMEOUT = 60.0


def serve_command(home: Path, listen: str, token_file: Path, *, tls: bool = True,
                  extra: Sequence[str] = ()) -> list[str]:
    """The command line of ``capsule serve`` for a store, an address and a token file (TLS, or plain HTTP);
    ``extra``: more of its options (e.g. limits)."""
    return [sys.executable, "-m", "capsule.cli.main", "--home", str(home), "serve", "--listen", listen,
            "--token-file", str(token_file), *([] if tls else ["--insecure-http"]), *extra]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class AgentProcess:
    """``capsule serve`` for the store at ``home`` on ``host:port`` (a free port if none is given)."""

    def __init__(self, home: Path, token_file: Path, port: int | None = None, *, host: str = "127.0.0.1",
                 log_path: Path | None = None, timeout: float = START_TIMEOUT,
                 env: Mapping[str, str] | None = None, tls: bool = False, extra: Sequence[str] = ()) -> None:
        self.home = Path(home)
        self.token_file = Path(token_file)
        self.host = host
        self.port = port or free_port(host)
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://{host}:{self.port}"
        self.fingerprint: str | None = None  # with tls: the certificate's, once it answers
        self.log_path = log_path or self.token_file.with_suffix(".log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(serve_command(self.home, f"{host}:{self.port}", self.token_file, tls=tls,
                                                       extra=extra),
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

        from capsule.agent.serve import TLS_DIR
        from hashcache.transport import tls

        cert = self.home / TLS_DIR / tls.CERT_NAME
        deadline = time.monotonic() + timeout
        while True:
            if self.token_file.exists() and (not self.tls or cert.exists()):
                with contextlib.suppress(httpx.TransportError, OSError, ValueError):
                    pin = tls.cert_fingerprint(cert) if self.tls else None
                    r = httpx.get(f"{self.url}/v1/info", headers={"Authorization": f"Bearer {self.token}"},
                                  timeout=5.0, verify=tls.client_context(pin) if pin else True)
                    if r.status_code == 200:
                        self.fingerprint = pin
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
