"""READ over the agent's block stream (WebSocket): same blocks as HTTP, refusals that leave the
connection usable, a pool that reuses connections, and the HTTP fallback for an agent without one."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from diskserver.errors import SourceError
from diskserver.source import HcpSource
from hashcache.blocks import BLOCK_SIZE, hash_block
from hashcache.hcp import decode_indices, decode_stream_reply, encode_stream_read, pack_blocks
from hashcache.transport.stream import BlockStream, HandshakeRefused, socket_connector
from testkit.images import make_store
from tests.conftest import Agent

pytestmark = pytest.mark.tools


@pytest.fixture
def host_a(tmp_path, tiny_images):
    """A store with the tiny image and its agent; (agent, token file, root layer id, its manifest)."""
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    layer = a.catalogue.image("tiny").root_layer
    manifest = a.layer_manifest(layer)
    agent = Agent(a.home, tmp_path / "a.token")
    yield agent, tmp_path / "a.token", layer, manifest
    agent.stop()
    a.close()


def _data_blocks(manifest, n: int) -> list[int]:
    return [i for i, z, _h in manifest.records() if not z][:n]


def test_stream_sends_the_same_verified_blocks_as_http(host_a):
    agent, token_file, layer, manifest = host_a
    want = _data_blocks(manifest, 40)
    over_stream = HcpSource(agent.url, token_file)
    over_http = HcpSource(agent.url, token_file, stream=False)
    try:
        over_stream.read_blocks(layer, want[:1])  # the first READ also opens the connection
        over_http.read_blocks(layer, want[:1])
        for batch in (want[:1], want[1:17], want[17:]):  # inline and threaded sizes on the agent
            a = over_stream.read_blocks(layer, batch)
            b = over_http.read_blocks(layer, batch)
            assert a.blocks == b.blocks
            for i, data in zip(batch, a.blocks, strict=True):
                assert len(data) == BLOCK_SIZE and hash_block(data) == manifest.hash_of(i)
            assert a.wire_bytes < b.wire_bytes  # no HTTP headers per READ
        assert over_stream.stream_active  # it really used the stream
        uncompressed = HcpSource(agent.url, token_file, compress=False)
        assert uncompressed.read_blocks(layer, want[:3]).blocks == over_http.read_blocks(layer, want[:3]).blocks
        uncompressed.close()
    finally:
        over_stream.close()
        over_http.close()


def test_sequential_reads_reuse_one_connection_and_threads_share_a_pool(host_a):
    agent, token_file, layer, manifest = host_a
    want = _data_blocks(manifest, 64)
    stream = BlockStream(socket_connector(agent.url))
    token = token_file.read_text().strip()
    opened = [stream.exchange(token, encode_stream_read("layer", layer, [i], 1), 10)[1] >= 400 for i in want[:20]]
    assert opened == [True] + [False] * 19  # only the first READ paid for the handshake

    errors: list[Exception] = []

    def worker(part: list[int]) -> None:
        try:
            for i in part:
                stream.exchange(token, encode_stream_read("layer", layer, [i], 1), 10)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(want[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert 1 <= stream.idle() <= 4
    stream.close()
    assert stream.idle() == 0


def test_wrong_token_is_refused_at_once_not_retried(host_a, tmp_path):
    agent, _token_file, layer, manifest = host_a
    bad = tmp_path / "bad.token"
    bad.write_text("x" * 32)
    with pytest.raises(HandshakeRefused) as exc:
        BlockStream(socket_connector(agent.url)).exchange("x" * 32, encode_stream_read("layer", layer, [0], 1), 5)
    assert exc.value.status == 401
    src = HcpSource(agent.url, bad, retry_seconds=30)
    with pytest.raises(SourceError, match="HTTP 401"):
        src.read_blocks(layer, _data_blocks(manifest, 1))
    src.close()


def _ws(agent, token: str):
    return connect(agent.url.replace("http://", "ws://") + "/v1/objects/stream",
                   additional_headers={"Authorization": f"Bearer {token}"}, compression=None, legacy=True)


def test_bad_requests_get_error_replies_and_the_connection_stays_usable(host_a):
    agent, token_file, layer, manifest = host_a
    good = _data_blocks(manifest, 2)
    with _ws(agent, token_file.read_text().strip()) as ws:
        bad_requests = {
            b"\x00\x01": 400,                                                     # shorter than its head
            b"\x07" + bytes(32) + b"\x01": 400,                                    # unknown kind
            b"\x00" + bytes.fromhex(layer) + b"\x63": 400,                         # zstd level 99
            encode_stream_read("layer", "ab" * 32, [0], 1): 404,                   # no such layer
            encode_stream_read("layer", layer, [manifest.block_count + 5], 1): 400,  # beyond the layer
            encode_stream_read("layer", layer, good, 1)[:-1] + b"\xff": 400,        # truncated varint
        }
        for request, status in bad_requests.items():
            ws.send(request)
            payload, err = decode_stream_reply(ws.recv(timeout=10))
            assert payload is None and err["status"] == status, (request, err)
            assert err["detail"]
        ws.send(encode_stream_read("layer", layer, good, 0))
        payload, err = decode_stream_reply(ws.recv(timeout=10))
        assert not err and len(payload) == 2 * BLOCK_SIZE
        assert hash_block(payload[:BLOCK_SIZE]) == manifest.hash_of(good[0])
        ws.send("text is not a request")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1003


class _OldAgent(BaseHTTPRequestHandler):
    """An agent that predates the stream: HTTP READ only (blocks filled with their index)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass

    def do_GET(self) -> None:  # noqa: N802 - the WebSocket upgrade lands here
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        indices = decode_indices(body, 1 << 20)
        payload = pack_blocks([bytes([i % 256]) * BLOCK_SIZE for i in indices], level=1)
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def test_an_agent_without_the_stream_is_read_over_http(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OldAgent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "t"
    token.write_text("y" * 32)
    src = HcpSource(f"http://127.0.0.1:{server.server_port}", token)
    try:
        r = src.read_blocks("cd" * 32, [3, 9])
        assert r.blocks == [b"\x03" * BLOCK_SIZE, b"\x09" * BLOCK_SIZE]
        assert not src.stream_active  # it will not try again
        assert src.read_blocks("cd" * 32, [4]).blocks == [b"\x04" * BLOCK_SIZE]
    finally:
        src.close()
        server.shutdown()


def test_stream_error_replies_are_json_the_client_can_show():
    payload, err = decode_stream_reply(b"\x01" + json.dumps({"detail": "nope", "error": "NotFound",
                                                             "status": 404}).encode())
    assert payload is None and err == {"detail": "nope", "error": "NotFound", "status": 404}
    with pytest.raises(Exception, match="malformed stream reply"):
        decode_stream_reply(b"\x09junk")
