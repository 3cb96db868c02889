"""No token over plain HTTP to another machine unless this side was configured for it (hashcache/transport/plain.py):
the transports, the command line and the agent's routes that are handed a source URL. Refusals come before any
connection: every attempt to open one is recorded (and refused) here, and the address used is a documentation
address (TEST-NET-1) that routes nowhere anyway."""

from __future__ import annotations

import socket

import pytest
from fastapi.testclient import TestClient

from capsule import hosts
from capsule.agent.app import create_app
from capsule.agentclient import AgentClient
from capsule.store import Store
from diskserver.source import HcpSource
from hashcache.errors import InsecureTransport, Unreachable
from hashcache.transport import plain
from hashcache.transport.stream import socket_connector
from tests.unit.test_tls import cli

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN = "the-host-token-0123456789abcdef"
SOURCE_TOKEN = "the-source-token-0123456789abcdef"
FAR = "http://192.0.2.1:7070"       # TEST-NET-1: plain HTTP to another machine


@pytest.fixture
def connects(monkeypatch):
    """Every TCP connection this process tries to open (by address), each refused at once."""
    tried: list[tuple] = []

    def refuse(address, *args, **kw):  # noqa: ANN001, ANN002, ANN003
        tried.append(address)
        raise ConnectionRefusedError(111, "refused by the test")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv(plain.ENV, "0")   # not configured insecure (and put back as it was after the test)
    return tried


def test_a_token_over_plain_http_to_another_machine_is_refused_before_connecting(connects, tmp_path):
    refused = r"refused to send a token to http://192\.0\.2\.1:7070 over plain HTTP.*--insecure-http"
    with pytest.raises(InsecureTransport, match=refused) as exc, AgentClient(FAR, TOKEN) as client:
        client.get_json("/v1/info")
    assert exc.value.exit_code == 2 and exc.value.code == "insecure_http"
    store = Store.open(tmp_path / "a")
    try:
        with pytest.raises(InsecureTransport):
            hosts.add(store, "far", FAR, TOKEN)
        assert hosts.peers(store) == []
    finally:
        store.close()
    token_file = tmp_path / "source.token"
    token_file.write_text(SOURCE_TOKEN)
    with pytest.raises(InsecureTransport):               # the disk server's source (HTTP and the block stream)
        HcpSource(FAR, token_file)
    with pytest.raises(InsecureTransport):
        socket_connector(FAR)
    for url in ("http://10.0.0.5:7070", "http://[2001:db8::1]:7070", "http://work.example:7070",
                "http://127.0.0.1.work.example:7070", "http://127.0.0.1@work.example:7070", "ws://192.0.2.1:7070"):
        with pytest.raises(InsecureTransport):
            AgentClient(url, TOKEN) if url.startswith("http") else plain.check(url)
    assert connects == []


@pytest.mark.parametrize("url,where", [("http://127.0.0.1:1", ("127.0.0.1", 1)), ("http://127.8.9.10:1", None),
                                       ("http://[::1]:1", None), ("http://localhost:1", ("localhost", 1)),
                                       ("https://192.0.2.1:7070", ("192.0.2.1", 7070))])
def test_without_insecure_only_loopback_or_https_carries_a_token(connects, url, where):
    with pytest.raises(InsecureTransport):
        AgentClient(FAR, TOKEN)
    with AgentClient(url, TOKEN) as client, pytest.raises(Unreachable):
        client.get_json("/v1/info")
    assert len(connects) == 1 and (where is None or connects[0] == where)   # it did try: the test refused it


def test_configured_insecure_it_is_allowed(connects, monkeypatch):
    monkeypatch.setenv(plain.ENV, "1")           # what `capsule serve --insecure-http` / `capsule --insecure-http` set
    with AgentClient(FAR, TOKEN) as client, pytest.raises(Unreachable):
        client.get_json("/v1/info")
    assert connects == [("192.0.2.1", 7070)]
    monkeypatch.setenv(plain.ENV, "0")
    with pytest.raises(InsecureTransport):
        AgentClient(FAR, TOKEN)


def test_the_command_line_sends_over_plain_http_only_when_told(connects, tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSULE_HOME", str(tmp_path / "a"))
    token_file = tmp_path / "peer.token"
    token_file.write_text(TOKEN)
    code, out = cli("host", "add", "far", FAR, "--token-file", str(token_file))
    assert code == 2 and "over plain HTTP" in out and "--insecure-http" in out and connects == []
    code, out = cli("--insecure-http", "host", "add", "far", FAR, "--token-file", str(token_file))
    assert code == Unreachable.exit_code and connects == [("192.0.2.1", 7070)], out


@pytest.fixture
def agent(tmp_path):
    app = create_app(tmp_path / "b", TOKEN)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        yield client, tmp_path / "b"


@pytest.mark.parametrize("route,body", [
    ("/v1/fleet/pull", {"source": FAR, "token": SOURCE_TOKEN, "ref": "web@1"}),
    ("/v1/run", {"source": FAR, "token": SOURCE_TOKEN, "ref": "web@1"}),
    ("/v1/run", {"source": "http://work.example:7070", "token": SOURCE_TOKEN, "ref": "web"}),
])
def test_a_peer_handing_this_agent_a_plain_http_source_is_refused_before_any_contact(connects, agent, route, body):
    client, home = agent
    r = client.post(route, json=body)
    assert r.status_code == 400 and r.json()["error"] == "insecure_http", r.text
    assert "over plain HTTP" in r.json()["detail"] and connects == []
    assert client.get("/v1/fleet/activity").json()["pulls"] == []
    store = Store.open(home)
    try:
        assert store.catalogue.capsule("web") is None
    finally:
        store.close()
    assert not [p for p in home.rglob("*") if SOURCE_TOKEN.encode() in (p.read_bytes() if p.is_file() else b"")]
