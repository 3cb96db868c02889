"""The host side of the guest agent protocol: against the real agent binary
(relayed like QEMU's virtio-serial chardev) and against a misbehaving peer.
The host must never hang and must refuse garbage."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from capsule.runtime.guestagent import AgentError, AgentUnavailable, GuestAgent, wait_for_agent

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def agent_binary():
    subprocess.run(["make", "-s", "-C", str(ROOT / "guest-balloon")], check=True)
    return ROOT / "guest-balloon" / "capsule-agent"


class Relay:
    """What QEMU does for a virtio-serial port: the guest side (the agent) and
    the host side (our client) meet through a unix socket the host connects to."""

    def __init__(self, tmp: Path) -> None:
        self.guest_path = tmp / "guest.sock"
        self.host_path = tmp / "host.sock"
        self.guest_l = socket.socket(socket.AF_UNIX)
        self.guest_l.bind(str(self.guest_path))
        self.guest_l.listen(1)
        self.host_l = socket.socket(socket.AF_UNIX)
        self.host_l.bind(str(self.host_path))
        self.host_l.listen(4)
        self.stop = False
        self.host = None
        threading.Thread(target=self._run, daemon=True).start()

    def _from_guest(self, guest: socket.socket) -> None:
        try:
            while data := guest.recv(65536):
                host = self.host
                if host is not None:  # like a chardev with nobody connected, drop the bytes otherwise
                    with contextlib.suppress(OSError):
                        host.sendall(data)
        except OSError:
            pass

    def _run(self) -> None:
        guest, _ = self.guest_l.accept()
        self.host: socket.socket | None = None
        threading.Thread(target=self._from_guest, args=(guest,), daemon=True).start()
        while not self.stop:
            host, _ = self.host_l.accept()
            self.host = host
            try:
                while data := host.recv(65536):
                    guest.sendall(data)
            except OSError:
                pass
            self.host = None


def test_real_agent_ping_stats_balloon_exec(tmp_path, agent_binary):
    relay = Relay(tmp_path)
    proc = subprocess.Popen([str(agent_binary), "--device", str(relay.guest_path)], stderr=subprocess.DEVNULL)
    try:
        info = wait_for_agent(relay.host_path, timeout=10)
        assert info["protocol"] == 1
        with GuestAgent(relay.host_path) as agent:
            st = agent.stats()
            assert st["MemTotal"] > 0 and st["MemAvailable"] <= st["MemTotal"]
            r = agent.inflate(policy="none", max_bytes=16 << 20)
            assert r["held_bytes"] >= 16 << 20 and r["stop_reason"] == "max_bytes"
            assert agent.status()["held_bytes"] == r["held_bytes"]
            assert agent.deflate()["released_bytes"] == r["held_bytes"]
            out = agent.exec(["sh", "-c", "echo hi; exit 3"])
            assert out["stdout"] == "hi\n" and out["exit_code"] == 3
            with pytest.raises(AgentError, match="unknown"):
                agent.call("no.such.command")
    finally:
        proc.terminate()
        proc.wait(5)
        relay.stop = True


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
