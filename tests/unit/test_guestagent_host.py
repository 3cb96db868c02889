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
from tests.helpers.fakeagent import reply, requests

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


def _answering_agent(seen: list[str], drop_first: bool):
    """A fake agent answering every request with its command's name; with ``drop_first`` the first request
    vanishes, as the guest kernel discards a port's unread data when the agent reopens it just then."""

    def behaviour(conn):
        dropped = not drop_first
        for req, _n in requests(conn):
            seen.append(req["cmd"])
            if not dropped:
                dropped = True
                continue
            reply(conn, req["id"], {"cmd": req["cmd"]})

    return behaviour


def test_a_request_lost_at_connect_is_resent_as_a_ping_not_waited_on(tmp_path):
    seen: list[str] = []
    path = _fake_agent(tmp_path, _answering_agent(seen, drop_first=True))
    with GuestAgent(path, timeout=2) as agent:
        # without the confirming pings the exec itself would be the lost request, waited on for 60 s
        assert agent.call("exec", {"argv": ["true"]}, timeout=60) == {"cmd": "exec"}
        assert agent.call("stats") == {"cmd": "stats"}
    assert seen == ["ping", "ping", "exec", "stats"]  # one lost ping resent; a confirmed connection pings no more


def test_a_ping_confirms_its_own_connection(tmp_path):
    seen: list[str] = []
    path = _fake_agent(tmp_path, _answering_agent(seen, drop_first=False))
    with GuestAgent(path, timeout=2) as agent:
        assert agent.ping() == {"cmd": "ping"}
        assert agent.call("exec", {"argv": ["true"]}, timeout=5) == {"cmd": "exec"}
    assert seen == ["ping", "exec"]


def test_a_silent_agent_fails_the_confirmation_within_the_calls_deadline(tmp_path):
    path = _fake_agent(tmp_path, lambda conn: time.sleep(8))
    t = time.monotonic()
    with pytest.raises(AgentUnavailable, match="did not answer"), GuestAgent(path, timeout=1) as agent:
        agent.call("exec", {"argv": ["true"]}, timeout=3)
    assert time.monotonic() - t < 6
