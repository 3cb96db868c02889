"""The agent client tries an idempotent call again when its connection breaks or stalls (a congested
slow link), never a call that is not idempotent, and fails at once on a refused connection."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from capsule.agentclient import AgentClient
from capsule.errors import Unreachable
from tests.conftest import free_port

pytestmark = pytest.mark.unit


class _Flaky(BaseHTTPRequestHandler):
    """Drops the connection without an answer for the first ``drops`` requests, then answers."""

    protocol_version = "HTTP/1.1"
    drops = 0
    seen = 0

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass

    def _answer(self) -> None:
        cls = type(self)
        cls.seen += 1
        if cls.seen <= cls.drops:
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._answer()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer()


@pytest.fixture
def flaky():
    handler = type("Handler", (_Flaky,), {"drops": 2, "seen": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_an_idempotent_call_is_tried_again_after_a_broken_connection(flaky):
    handler, url = flaky
    with AgentClient(url, "t" * 32) as client:
        t = time.monotonic()
        assert client.get_json("/v1/info") == {"ok": True}
        assert handler.seen == 3  # two dropped, the third answered
        assert time.monotonic() - t >= 3.0  # backed off 1 s, then 2 s
        assert client.request("POST", "/v1/objects/layer/x/read", content=b"\x00", idempotent=True).json()


def test_a_call_that_is_not_idempotent_is_not_repeated(flaky):
    handler, url = flaky
    with AgentClient(url, "t" * 32) as client, pytest.raises(Unreachable, match="cannot reach the agent"):
        client.post_json("/v1/versions", {"capsule": "x"})
    assert handler.seen == 1


def test_a_refused_connection_fails_at_once():
    with AgentClient(f"http://127.0.0.1:{free_port()}", "t" * 32) as client:
        t = time.monotonic()
        with pytest.raises(Unreachable, match="cannot reach the agent"):
            client.get_json("/v1/info")
        assert time.monotonic() - t < 1.0
