"""A peer's console through this agent: the page signs in here only; this agent asks the peer (with the peer's
token) and relays the frames. The peer is a real agent app on uvicorn in a thread; its "screen" an echo server."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse

from capsule import audit, capsules, hosts
from capsule.agent.app import create_app
from capsule.lifecycle.memimage import VNC_SOCKET
from capsule.store import Store
from capsule.store.catalogue import InstanceRow
from tests.helpers.inprocess_agent import InProcessAgent
from tests.unit.test_console_api import EchoServer, refused
from tests.unit.test_dashboard_api import PEER_TOKEN, TOKEN, _fake_image, sign_in

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture(params=[False, True], ids=["http", "tls"])
def peer(request, tmp_path):
    """The peer, over plain HTTP or TLS (then the relay's WebSocket to it is pinned to its certificate)."""
    store = Store.open(tmp_path / "b")
    _fake_image(store)
    capsules.create(store, "desk", "img", memory="256M")
    capsules.create(store, "off", "img", memory="256M")
    inst = tmp_path / "inst-b"
    inst.mkdir()
    store.catalogue.add_instance(InstanceRow(capsule="desk", version=1, domain="d-desk", leaves=[], chains=[],
                                             accel="tcg", dir=str(inst)))
    store.close()
    server = EchoServer(inst / VNC_SOCKET)
    agent = InProcessAgent(tmp_path / "b", PEER_TOKEN, tls_dir=tmp_path / "b-tls" if request.param else None)
    yield agent, server
    agent.stop()
    server.stop()


@pytest.fixture
def client(tmp_path, peer):
    store = Store.open(tmp_path / "a")
    hosts.add(store, "home", peer[0].url, PEER_TOKEN, fingerprint=peer[0].fingerprint)
    store.close()
    return TestClient(create_app(tmp_path / "a", TOKEN))


def relay_ticket(client: TestClient, csrf: str, host: str, name: str) -> dict:
    r = client.post(f"/api/hosts/{host}/capsules/{name}/console-ticket", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200, r.text
    return r.json()


def test_peer_console_is_relayed_both_ways(client, peer):
    csrf = sign_in(client)
    t = relay_ticket(client, csrf, "home", "desk")
    assert t["url"] == f"/api/hosts/home/console/desk?ticket={t['ticket']}"
    with client.websocket_connect(t["url"], subprotocols=["binary"]) as ws:
        assert ws.accepted_subprotocol == "binary"
        assert ws.receive_bytes() == b"RFB 003.008\n"
        ws.send_bytes(b"through two agents")
        assert ws.receive_bytes() == b"THROUGH TWO AGENTS"
    assert peer[1].closed.wait(10)       # closing the page's end closed the peer's and the screen's


def test_relay_refusals(client):
    assert client.post("/api/hosts/home/capsules/desk/console-ticket").status_code == 401
    csrf = sign_in(client)
    h = {"X-CSRF-Token": csrf}
    assert client.post("/api/hosts/nowhere/capsules/desk/console-ticket", headers=h).status_code == 404
    # a ticket for a peer's capsule opens neither another of its capsules nor the capsule of that name here
    t = relay_ticket(client, csrf, "home", "desk")["ticket"]
    assert refused(client, f"/api/hosts/home/console/off?ticket={t}") == 403
    t = relay_ticket(client, csrf, "home", "desk")["ticket"]
    assert refused(client, f"/api/console/desk?ticket={t}") == 403
    # the peer's own refusal comes through: its capsule is not running
    t = relay_ticket(client, csrf, "home", "off")["ticket"]
    url = f"/api/hosts/home/console/off?ticket={t}"
    with pytest.raises(WebSocketDenialResponse) as info, client.websocket_connect(url):
        pass
    assert info.value.status_code == 409 and "not running" in info.value.text


def test_peer_checks_its_own_session_for_the_direct_console(peer):
    """The peer's console WebSocket needs a session or its token there too: over a real server, no session is 401."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from hashcache.transport import tls

    agent, _ = peer
    pinned = {"ssl": tls.client_context(agent.fingerprint)} if agent.fingerprint else {}
    with pytest.raises(InvalidStatus) as info:
        connect(agent.url.replace("http", "ws", 1) + "/api/console/desk?ticket=x", open_timeout=5, **pinned)
    assert info.value.response.status_code == 401


def test_relayed_console_is_audited_with_its_host(client, peer, tmp_path):
    csrf = sign_in(client)
    t = relay_ticket(client, csrf, "home", "desk")
    with client.websocket_connect(t["url"]) as ws:
        assert ws.receive_bytes() == b"RFB 003.008\n"
    got = [(e["action"], e["capsule"], e["result"]) for e in audit.entries(tmp_path / "a") if "console" in e["action"]]
    assert got == [("POST /api/hosts/{host}/capsules/{name}/console-ticket", "home/desk", "ok"),
                   ("WS /api/hosts/{host}/console/{name}", "home/desk", "ok")]
