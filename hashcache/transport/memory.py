"""The transports of the unit tier: the same HTTP and stream implementations, driven in-process
against an ASGI app (the agent's own ``create_app``, or any app speaking the protocol) — no sockets,
no processes, the real request handling."""

from __future__ import annotations

import warnings
from typing import Any

import httpx

from hashcache.transport.base import TokenSource
from hashcache.transport.http import HttpTransport
from hashcache.transport.stream import STREAM_PATH, HandshakeRefused, StreamTransport

URL = "http://testserver"


def _test_client(app: Any) -> httpx.Client:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # starlette's note about its httpx dependency
        from starlette.testclient import TestClient

        return TestClient(app, base_url=URL, raise_server_exceptions=False)


class _Session:
    """One in-process WebSocket session, as a stream :class:`~hashcache.transport.stream.Connection`."""

    def __init__(self, client: Any, token: str) -> None:
        from starlette.testclient import WebSocketDenialResponse
        from starlette.websockets import WebSocketDisconnect

        try:
            self._cm = client.websocket_connect(STREAM_PATH, headers={"Authorization": f"Bearer {token}"})
            self._session = self._cm.__enter__()
        except WebSocketDenialResponse as exc:
            raise HandshakeRefused(exc.status_code, exc.reason_phrase) from None
        except WebSocketDisconnect:  # closed before accept: what a server without the route does
            raise HandshakeRefused(403, "Forbidden") from None

    def exchange(self, message: bytes, timeout: float) -> bytes:
        self._session.send_bytes(message)
        msg = self._session.receive()
        if msg["type"] != "websocket.send" or msg.get("bytes") is None:
            raise ConnectionError("the agent closed the block stream")
        data: bytes = msg["bytes"]
        return data

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def in_process(app: Any, token: TokenSource | str, *, stream: bool = True,
               wrap: Any = None) -> HttpTransport | StreamTransport:
    """A transport to ``app`` in this process: HTTP, and READ over the stream unless ``stream`` is False.
    ``wrap`` (an ``httpx.BaseTransport`` → ``httpx.BaseTransport``) may put a fault injector under HTTP."""
    client = _test_client(app)
    if wrap is not None:
        client._transport = wrap(client._transport)  # noqa: SLF001 - the test client's own ASGI transport
    tok = token if isinstance(token, TokenSource) else TokenSource(token)
    http = HttpTransport(URL, tok, client=client)
    if not stream:
        return http
    return StreamTransport(http, tok, connect=lambda t, _timeout: _Session(client, t))
