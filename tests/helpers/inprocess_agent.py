"""A real agent app (``create_app``) served by uvicorn on a loopback port from a thread of the test
process: a peer for unit tests that start no process. ``stop()`` makes the peer go away. With ``tls_dir`` it
serves TLS with the host key there (made if missing, as ``capsule serve`` does): ``url`` is https and
``fingerprint`` the certificate's, which clients pin; ``port`` restarts a peer where it was."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn

from capsule.agent.app import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessAgent:
    def __init__(self, home: Path, token: str, *, tls_dir: Path | None = None, port: int | None = None) -> None:
        from hashcache.transport import tls

        self.token = token
        self.port = port or free_port()
        cert = tls.ensure_host_cert(tls_dir) if tls_dir is not None else None
        self.fingerprint = cert.fingerprint if cert else None
        self.url = f"{'https' if cert else 'http'}://127.0.0.1:{self.port}"
        self.app = create_app(home, token)
        self.app.state.tls_fingerprint = self.fingerprint
        files = {"ssl_certfile": str(cert.cert), "ssl_keyfile": str(cert.key)} if cert else {}
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", **files)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the in-process agent did not start on {self.url}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class SilentPeer:
    """A loopback port that accepts connections and never answers (a hung host)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()
