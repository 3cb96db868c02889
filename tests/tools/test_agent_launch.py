"""The one helper that starts an agent process and waits for it (capsule/agent/launch.py). These
tests start real processes (no guests, no images)."""

from __future__ import annotations

import socket

import httpx
import pytest

from capsule.agent.launch import AgentProcess
from capsule.errors import Unreachable

pytestmark = [pytest.mark.tools, pytest.mark.timeout(120)]


def test_starts_answers_and_stops(tmp_path):
    with AgentProcess(tmp_path / "home", tmp_path / "a.token") as agent:
        assert agent.running and len(agent.token) >= 16  # `capsule serve` made the token file
        r = httpx.get(f"{agent.url}/v1/info", headers={"Authorization": f"Bearer {agent.token}"})
        assert r.status_code == 200 and r.json()["store_id"]
        assert httpx.get(f"{agent.url}/v1/info").status_code == 401
    assert not agent.running
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{agent.url}/v1/info", timeout=2.0)


def test_a_tls_agent_makes_its_host_key_once_and_hands_out_its_fingerprint(tmp_path):
    """`capsule serve` without --insecure-http: TLS on a host key made on first start (0600) and kept across
    restarts; the launcher gives the fingerprint clients pin, and the log names it as `host add` shows it."""
    from hashcache.transport import tls

    with AgentProcess(tmp_path / "home", tmp_path / "a.token", tls=True) as agent:
        assert agent.url.startswith("https://") and agent.fingerprint
        assert (tmp_path / "home" / "tls" / "host.key").stat().st_mode & 0o777 == 0o600
        pinned = tls.client_context(agent.fingerprint)
        r = httpx.get(f"{agent.url}/v1/info", headers={"Authorization": f"Bearer {agent.token}"}, verify=pinned)
        assert r.status_code == 200
        with pytest.raises(httpx.ConnectError):  # no pin: the self-signed certificate is not trusted
            httpx.get(f"{agent.url}/v1/info", timeout=5)
        with pytest.raises(httpx.TransportError):  # no plain HTTP on the TLS port
            httpx.get(agent.url.replace("https://", "http://") + "/v1/info", timeout=5)
        first = agent.fingerprint
        assert f"new host key; certificate fingerprint {first}" in agent.log()
    with AgentProcess(tmp_path / "home", tmp_path / "a.token", tls=True) as again:
        assert again.fingerprint == first  # the same key after a restart: pins stay valid


def test_an_agent_that_cannot_start_fails_at_once_with_its_log(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(Unreachable, match="exited") as exc:
            AgentProcess(tmp_path / "home", tmp_path / "a.token", port, timeout=60)
    assert "address already in use" in str(exc.value).lower()


def test_a_deadline_bounds_the_wait_and_the_late_agent_is_stopped(tmp_path, monkeypatch):
    started = []
    real_popen = __import__("subprocess").Popen

    def popen(*args, **kw):  # noqa: ANN002, ANN003
        started.append(real_popen(*args, **kw))
        return started[-1]

    monkeypatch.setattr("capsule.agent.launch.subprocess.Popen", popen)
    with pytest.raises(Unreachable, match="did not answer"):
        AgentProcess(tmp_path / "home", tmp_path / "a.token", timeout=0.01)  # no interpreter starts that fast
    assert started and started[0].poll() is not None  # not left running
