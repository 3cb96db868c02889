"""The host side of the guest agent protocol: against the real agent binary
(relayed like QEMU's virtio-serial chardev) and against a misbehaving peer.
The host must never hang and must refuse garbage."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from capsule.runtime.guestagent import AgentError, AgentUnavailable, GuestAgent

pytestmark = pytest.mark.unit


def _fake_agent(tmp_path: Path, behaviour) -> Path:  # noqa: ANN001
    path = tmp_path / "fake.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            behaviour(conn)

    threading.Thread(target=serve, daemon=True).start()
    return path


def test_silent_agent_times_out(tmp_path):
    path = _fake_agent(tmp_path, lambda conn: time.sleep(5))
    t = time.monotonic()
    with pytest.raises(AgentUnavailable, match="did not answer"), GuestAgent(path, timeout=0.5) as agent:
        agent.ping()
    assert time.monotonic() - t < 2


def test_garbage_and_wrong_ids_are_skipped(tmp_path):
    def behaviour(conn):
        got = b""
        while b"ping" not in got:
            got += conn.recv(1024)
        conn.sendall(b"not json\n\n[1,2]\n" + b'{"id": 999, "ok": true, "result": {}}\n'
                     + b'{"id": 1, "ok": true, "result": {"version": "x"}}\n')
        time.sleep(1)

    path = _fake_agent(tmp_path, behaviour)
    with GuestAgent(path, timeout=2) as agent:
        assert agent.ping() == {"version": "x"}


def test_oversized_line_is_refused(tmp_path):
    def behaviour(conn):
        got = b""
        while b"ping" not in got:
            got += conn.recv(1024)
        chunk = b"x" * (1 << 20)
        try:
            for _ in range(40):
                conn.sendall(chunk)
        except OSError:
            pass

    path = _fake_agent(tmp_path, behaviour)
    with pytest.raises(AgentUnavailable, match="longer than"), GuestAgent(path, timeout=10) as agent:
        agent.ping()


def test_error_reply_and_closed_channel(tmp_path):
    def behaviour(conn):
        got = b""
        while b"ping" not in got:  # the host first sends a bare newline, then the request
            got += conn.recv(1024)
        conn.sendall(b'{"id": 1, "ok": false, "error": "nope"}\n')

    path = _fake_agent(tmp_path, behaviour)
    with GuestAgent(path, timeout=2) as agent:
        with pytest.raises(AgentError, match="nope"):
            agent.ping()
        with pytest.raises(AgentUnavailable):
            agent.ping()


def test_no_channel_at_all(tmp_path):
    with pytest.raises(AgentUnavailable, match="no guest agent channel"):
        GuestAgent(tmp_path / "missing.sock")
    assert not os.path.exists(tmp_path / "missing.sock")
