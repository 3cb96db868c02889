"""The agent's limits on one client (capsule/agent/limits.py), against a real `capsule serve` process:
connections per client address, a slow-loris client's trickled headers, request bodies and WebSocket
messages. Over a limit the client is told so clearly, and the agent keeps serving everyone else."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from capsule.agent.launch import AgentProcess
from capsule.agent.limits import Limits

pytestmark = [pytest.mark.tools, pytest.mark.timeout(120)]


def _agent(tmp_path, *extra: str) -> AgentProcess:
    return AgentProcess(tmp_path / "home", tmp_path / "a.token", extra=extra)


def _info(agent: AgentProcess, local_address: str = "127.0.0.1") -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=local_address), timeout=10.0) as c:
        return c.get(f"{agent.url}/v1/info", headers={"Authorization": f"Bearer {agent.token}"})


def _open(agent: AgentProcess, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection((agent.host, agent.port), timeout=10.0, source_address=(source, 0))
    return s


def _read_reply(s: socket.socket, deadline: float = 15.0) -> bytes:
    """Everything the agent sends until it closes the connection."""
    s.settimeout(deadline)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _json_of(reply: bytes) -> dict:
    return json.loads(reply.partition(b"\r\n\r\n")[2])


def test_one_client_over_its_connections_is_told_so_and_others_are_served(tmp_path):
    with _agent(tmp_path, "--max-connections-per-client", "4", "--header-timeout", "60") as agent:
        held = [_open(agent) for _ in range(4)]
        for s in held:
            s.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        time.sleep(0.3)
        extra = _open(agent)
        reply = _read_reply(extra)
        assert reply.startswith(b"HTTP/1.1 429 ")
        body = _json_of(reply)
        assert body["error"] == "overloaded" and "at most 4" in body["detail"]
        # another address is served as before while this one is at its limit
        assert _info(agent, "127.0.0.2").status_code == 200
        for s in held:
            s.close()
        time.sleep(0.3)
        # the closed connections were given back: the same address is served again, many times over
        for _ in range(10):
            assert _info(agent).status_code == 200


def test_trickled_headers_are_cut_off_with_408_on_a_new_and_a_kept_alive_connection(tmp_path):
    with _agent(tmp_path, "--header-timeout", "1") as agent:
        slow = _open(agent)
        started = time.monotonic()
        got = b""
        slow.settimeout(0.3)
        for piece in [b"GET /v1/info HTTP/1.1\r\n", b"Host: x\r\n", *[b"X-Pad: y\r\n"] * 40]:
            try:
                slow.sendall(piece)
                got += slow.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if got:
                break
        got += _read_reply(slow)
        assert got.startswith(b"HTTP/1.1 408 ") and _json_of(got)["error"] == "request_timeout"
        assert time.monotonic() - started < 10  # cut off, not served for the 12 s the trickle would take

        # a kept-alive connection: one whole request, then the next one's headers trickle
        kept = _open(agent)
        kept.sendall(f"GET /v1/info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {agent.token}\r\n\r\n".encode())
        kept.settimeout(10)
        first = b""
        while b'"store_id"' not in first:  # the whole first answer (its body comes after its head)
            first += kept.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b"}")
        kept.sendall(b"GET /v1/info HTTP/1.1\r\n")
        assert _read_reply(kept).startswith(b"HTTP/1.1 408 ")
        # a client that finishes its headers in time is not affected
        assert _info(agent).status_code == 200
        # an idle kept-alive connection is not cut off by the header timeout (uvicorn's keep-alive rules it)
        with httpx.Client(timeout=10.0) as c:
            first = c.get(f"{agent.url}/v1/info", headers={"Authorization": f"Bearer {agent.token}"})
            time.sleep(2.5)
            again = c.get(f"{agent.url}/v1/info", headers={"Authorization": f"Bearer {agent.token}"})
            assert first.status_code == again.status_code == 200
            assert again.extensions["network_stream"] is first.extensions["network_stream"]  # the same one


def test_a_body_over_the_limit_is_refused_before_the_route_and_the_agent_keeps_serving(tmp_path):
    big = b'{"versions": ["' + b"a" * (Limits.max_body + 10) + b'"]}'
    with _agent(tmp_path) as agent:
        headers = {"Authorization": f"Bearer {agent.token}", "Content-Type": "application/json"}
        r = httpx.post(f"{agent.url}/v1/verify", content=big, headers=headers, timeout=30)
        assert r.status_code == 413 and r.json()["error"] == "too_large"
        assert str(Limits.max_body) in r.json()["detail"]

        def chunks():  # no Content-Length: counted as it streams
            for i in range(0, len(big), 65536):
                yield big[i:i + 65536]
        r = httpx.post(f"{agent.url}/v1/verify", content=chunks(), headers=headers, timeout=30)
        assert r.status_code == 413 and r.json()["error"] == "too_large"
        # a body within the limit still reaches the route (which answers it: nothing to verify)
        r = httpx.post(f"{agent.url}/v1/verify", json={"versions": []}, headers=headers, timeout=30)
        assert r.status_code == 200
        assert _info(agent).status_code == 200


def test_a_websocket_message_over_the_limit_closes_that_connection_only_and_counts_are_given_back(tmp_path):
    with _agent(tmp_path, "--max-connections-per-client", "3") as agent:
        url = agent.url.replace("http", "ws", 1) + "/v1/objects/stream"
        auth = {"Authorization": f"Bearer {agent.token}"}
        with ws_connect(url, additional_headers=auth) as ws:
            ws.send(b"\0" * (Limits.ws_max_message + 1))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big
        # WebSocket connections count against the client's limit and are given back when they close
        for _ in range(8):
            with ws_connect(url, additional_headers=auth) as ws:
                ws.send(b"\x01")  # a malformed READ: answered with an error reply, the connection stays
                assert ws.recv(timeout=10)
        with contextlib.ExitStack() as held:
            for _ in range(3):
                held.enter_context(ws_connect(url, additional_headers=auth))
            assert _read_reply(_open(agent)).startswith(b"HTTP/1.1 429 ")
        time.sleep(0.3)
        assert _info(agent).status_code == 200


def _slow_reader(agent: AgentProcess) -> tuple[socket.socket, bytes]:
    """A connection with a small receive window, and a READ request for 4 MiB of random blocks on it: most
    of the answer waits in the agent's socket queue until this side reads it."""
    import os

    from capsule.store import Store
    from hashcache.hcp import encode_indices

    store = Store.open(agent.home)
    img = agent.home / "image"
    img.write_bytes(os.urandom(4 << 20))
    row = store.seal_file(img, "memory")
    store.catalogue.add_file(row)
    store.close()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    s.connect((agent.host, agent.port))
    body = encode_indices(range(1024))
    s.sendall(f"POST /v1/objects/file/{row.id}/read?level=1 HTTP/1.1\r\nHost: x\r\n"
              f"Authorization: Bearer {agent.token}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return s, b"GET /v1/info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + agent.token.encode() + b"\r\n\r\n"


def _answer(s: socket.socket, pace: float) -> bytes:
    """One whole HTTP answer (by its Content-Length), read 64 KiB at a time every ``pace`` seconds."""
    s.settimeout(15.0)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, "the agent closed the connection instead of answering"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(rest) < length:
        time.sleep(pace)
        chunk = s.recv(65536)
        assert chunk, f"the agent closed the connection after {len(rest)} of {length} bytes of the answer"
        rest += chunk
    return head


def test_a_connection_whose_answer_is_still_on_its_way_is_not_idle_and_a_stalled_one_is_closed(tmp_path):
    """keep-alive 1 s: an answer read over ~6 s keeps its connection (the next request on it is answered);
    a client that reads nothing for 5 s finds the connection closed once it has read what was queued."""
    with _agent(tmp_path, "--keep-alive", "1") as agent:
        s, again = _slow_reader(agent)
        assert _answer(s, pace=0.1).startswith(b"HTTP/1.1 200 ")
        s.sendall(again)
        assert _answer(s, pace=0).startswith(b"HTTP/1.1 200 ")   # the same connection, kept
        s.close()

        stalled, _again = _slow_reader(agent)
        time.sleep(5.0)                                   # no progress for more than STALLED_PERIODS (2) of 1 s
        assert _answer(stalled, pace=0).startswith(b"HTTP/1.1 200 ")   # what was queued still arrives
        stalled.settimeout(5.0)
        assert stalled.recv(65536) == b""                 # then the agent's close
        stalled.close()


def test_a_body_trickled_a_byte_at_a_time_is_cut_off_with_408(tmp_path):
    """header timeout 1 s, at least 64 bytes/s of a body: a POST whose body comes a byte every 0.2 s is
    answered 408 and closed within a few seconds (it held its connection for ever), and others are served."""
    with _agent(tmp_path, "--header-timeout", "1") as agent:
        s = _open(agent)
        s.sendall(b"POST /v1/objects/missing HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + agent.token.encode() + b"\r\nContent-Length: 1000\r\n\r\n")
        started, got = time.monotonic(), b""
        s.settimeout(0.2)
        while time.monotonic() - started < 15 and not got.endswith(b"}"):
            with contextlib.suppress(TimeoutError, OSError):
                s.sendall(b" ")
                got += s.recv(65536)
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert "slower than 64 bytes/s" in _json_of(got)["detail"]
        assert time.monotonic() - started < 5
        try:
            rest = _read_reply(s, 5.0)
        except ConnectionResetError:      # closed too: a space sent after its answer draws a reset, not a FIN
            rest = b""
        assert rest == b""
        assert _info(agent).status_code == 200



def test_a_websocket_outlives_the_header_and_body_timers_of_the_request_that_opened_it(tmp_path):
    """The upgrade request's HTTP timers stay with HTTP: a WebSocket open for many header timeouts, quiet or
    busy, is never answered 408 in the middle of its frames nor closed (a live move's tunnel was cut 20 s
    after it opened, its stream corrupted by an HTTP reply)."""
    with _agent(tmp_path, "--header-timeout", "0.5", "--min-body-rate", "64") as agent:
        url = agent.url.replace("http", "ws", 1) + "/v1/objects/stream"
        with ws_connect(url, additional_headers={"Authorization": f"Bearer {agent.token}"}) as ws:
            until = time.monotonic() + 3.0          # six header timeouts
            while time.monotonic() < until:
                ws.send(b"\x01")                    # a malformed READ: answered with an error reply
                assert ws.recv(timeout=10)
                time.sleep(0.4)
            time.sleep(1.5)                         # and quiet for three more
            ws.send(b"\x01")
            assert ws.recv(timeout=10)
