"""X-Forwarded-For and X-Forwarded-Proto reach the agent's app only from the proxies `capsule serve
--trust-proxy` names: by default the connection's own address and scheme count (uvicorn alone would believe
them from 127.0.0.1). Seen through what the app does with them: the address the audit log records for a
refused change, and whether the dashboard's session cookie is marked Secure (only over https). Real agent
processes (capsule/agent/launch.py), no guests."""

from __future__ import annotations

import json

import httpx
import pytest

from capsule.agent.launch import AgentProcess

pytestmark = [pytest.mark.tools, pytest.mark.timeout(120)]

FORGED = {"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"}


def _seen(agent: AgentProcess) -> tuple[str, bool]:
    """(the client address the agent's audit log records, whether its sign-in cookie is Secure), for calls
    that carry FORGED headers."""
    r = httpx.post(f"{agent.url}/v1/capsules/web/stop", headers={"Authorization": "Bearer wrong-token-0123456789",
                                                                  **FORGED})
    assert r.status_code == 401
    last = json.loads((agent.home / "audit.log").read_text().splitlines()[-1])
    assert last["action"] == "POST /v1/capsules/{name}/stop" and last["result"] == "auth_failed"
    r = httpx.post(f"{agent.url}/api/session", json={"token": agent.token}, headers=FORGED)
    assert r.status_code == 200, r.text
    cookie = r.headers["set-cookie"].lower()
    return last["from"], "; secure" in cookie


def test_forwarded_headers_are_ignored_unless_the_proxy_is_trusted(tmp_path):
    with AgentProcess(tmp_path / "home", tmp_path / "a.token") as agent:
        assert _seen(agent) == ("127.0.0.1", False)          # the connection's own: loopback, plain HTTP
    with AgentProcess(tmp_path / "home", tmp_path / "a.token", extra=["--trust-proxy", "10.9.9.9"]) as agent:
        assert _seen(agent) == ("127.0.0.1", False)          # from an address that is not the proxy: ignored
    with AgentProcess(tmp_path / "home", tmp_path / "a.token", extra=["--trust-proxy", "127.0.0.1"]) as agent:
        assert _seen(agent) == ("203.0.113.9", True)         # from the configured proxy: believed
        assert "X-Forwarded-For/-Proto believed from 127.0.0.1" in agent.log()
        assert f"other hosts reach it at {agent.url}" in agent.log()
