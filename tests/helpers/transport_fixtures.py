"""Agents to run the transport tests against: the real agent app (``create_app``) on a fresh store
holding one sealed file object, served by uvicorn on a loopback port in a thread, or driven in-process;
and a fault injector that drops the first connections."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hashcache.blocks import BLOCK_SIZE

TOKEN = "conformance-token-0123456789"
NBLOCKS = 40


def block(i: int) -> bytes:
    return (i + 1).to_bytes(4, "little") * (BLOCK_SIZE // 4)  # distinct, never all zero


class Dropper:
    """An ASGI wrapper that breaks the first ``drops`` connections: HTTP answers that stop half-way (the
    server closes the connection), WebSocket sessions closed after the request arrived."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.drops = 0
        self.seen = 0

    def _take(self) -> bool:
        self.seen += 1
        if self.drops > 0:
            self.drops -= 1
            return True
        return False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self._take():
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]})
            await send({"type": "http.response.body", "body": b"{", "more_body": True})
            raise ConnectionAbortedError("dropped on purpose")
        if scope["type"] == "websocket" and self._take():
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            await receive()  # the request
            await send({"type": "websocket.close", "code": 1011})
            return
        await self.app(scope, receive, send)


class DroppingTransport(httpx.BaseTransport):
    """Under an in-process HTTP client: the first ``drops`` requests get no answer (a broken connection).
    (WebSocket sessions pass: :class:`Dropper` breaks those in the app.)"""

    def __init__(self, inner: httpx.BaseTransport, dropper: Dropper) -> None:
        self.inner = inner
        self.dropper = dropper

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme in ("http", "https") and self.dropper._take():  # noqa: SLF001
            raise httpx.RemoteProtocolError("server disconnected without sending a response", request=request)
        return self.inner.handle_request(request)


@dataclass
class AgentUnderTest:
    app: Any
    dropper: Dropper
    file_id: str
    data: list[bytes]
    url: str | None = None  # set when served over TCP
    tls_url: str | None = None  # set when served over TCP with TLS
    fingerprint: str | None = None  # of that TLS server's certificate


@contextlib.contextmanager
def agent_app(home: Path) -> Iterator[AgentUnderTest]:
    from capsule.agent.app import create_app
    from capsule.store import Store

    store = Store.open(home)
    data = [block(i) for i in range(NBLOCKS)]
    src = store.temp_path("-conformance")
    src.write_bytes(b"".join(data))
    row = store.seal_file(src, "kernel")
    with store.catalogue.transaction():
        store.catalogue.add_file(row)
    store.close()
    app = create_app(home, TOKEN)
    yield AgentUnderTest(app, Dropper(app), row.id, data)


@contextlib.contextmanager
def serve(agent: AgentUnderTest, cert: Any = None) -> Iterator[str]:
    """uvicorn on a free loopback port, in a thread (with TLS if given a
    :class:`~hashcache.transport.tls.HostCert`); the URL."""
    import uvicorn

    tls = {"ssl_certfile": str(cert.cert), "ssl_keyfile": str(cert.key)} if cert else {}
    config = uvicorn.Config(agent.dropper, host="127.0.0.1", port=0, log_level="critical", access_log=False,
                            **tls)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not (server.started and server.servers):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"{'https' if cert else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


assert BLOCK_SIZE == 4096 and len(block(0)) == BLOCK_SIZE
