"""The host side of the guest agent protocol against the real C agent (built with make, run as a
process)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from capsule.runtime.guestagent import AgentError, GuestAgent, wait_for_agent

pytestmark = pytest.mark.tools


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

