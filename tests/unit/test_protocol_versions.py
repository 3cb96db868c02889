"""Peers name their protocol and release: an agent answers with both, talks to the release before this one,
and refuses a client too old, or a 0.1.0 client asking for what 0.1.0 was given and this release no longer
gives (an all-purpose host grant), with a message naming both sides. A client refuses an agent too old."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from fastapi.testclient import TestClient

from capsule import __version__, capsules
from capsule.agent.app import create_app
from capsule.agentclient import AgentClient
from capsule.store import Store
from capsule.store.catalogue import ImageRow
from hashcache.errors import ProtocolMismatch
from hashcache.transport import HttpTransport, protocol

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN = "the-host-token-0123456789abcdef"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(tmp_path):
    store = Store.open(tmp_path / "s")
    store.catalogue.add_image(ImageRow(name="img", kind="tiny", root_layer=uuid.uuid4().hex * 2,
                                       kernel=uuid.uuid4().hex * 2, initrd=uuid.uuid4().hex * 2,
                                       cmdline="console=ttyS0", marker="READY", info={}, created=time.time()))
    capsules.create(store, "desk", "img", memory="256M")
    store.close()
    return TestClient(create_app(tmp_path / "s", TOKEN))


def test_every_answer_names_the_agents_protocol_and_release(client):
    for r in (client.get("/v1/info", headers=BEARER), client.get("/v1/info"), client.get("/")):
        assert r.headers[protocol.HEADER] == f"{protocol.PROTOCOL} capsule/{__version__}"
    assert protocol.of_agent(client.get("/v1/info").headers[protocol.HEADER]) == \
        protocol.Peer(__version__, protocol.PROTOCOL)


def test_a_client_of_the_release_before_is_served(client):
    r = client.get("/v1/capsules", headers=BEARER | {"User-Agent": "capsule"})       # what 0.1.0 sent
    assert r.status_code == 200 and [c["name"] for c in r.json()] == ["desk"]


def test_a_0_1_0_client_asking_for_an_all_purpose_grant_is_told_why_not(client):
    r = client.post("/v1/grants/host", json={"expires_in": 600}, headers=BEARER | {"User-Agent": "capsule"})
    assert r.status_code == 400 and r.json()["error"] == "protocol_mismatch"
    detail = r.json()["detail"]
    assert "0.1.0 or earlier (protocol 1)" in detail and f"capsule {__version__} (protocol 2)" in detail
    ok = client.post("/v1/grants/host", json={"allow": "read", "capsule": "desk", "expires_in": 600},
                     headers=BEARER | {"User-Agent": protocol.user_agent(__version__)})
    assert ok.status_code == 200 and ok.json()["allow"] == "read"


def test_a_client_too_old_is_refused_before_anything_else(client):
    r = client.get("/v1/info", headers={"User-Agent": "capsule/0.0.1 protocol/0"})    # not even a token
    assert r.status_code == 400 and r.json()["error"] == "protocol_mismatch"
    assert "capsule 0.0.1 (protocol 0)" in r.json()["detail"] and f"capsule {__version__}" in r.json()["detail"]
    assert r.headers[protocol.HEADER].startswith(str(protocol.PROTOCOL))


def test_browsers_and_scripts_are_not_capsule_peers(client):
    assert client.get("/v1/info", headers=BEARER | {"User-Agent": "curl/8.0"}).status_code == 200
    assert protocol.of_client("Mozilla/5.0 capsule") is None


def _agent(answer: str | None, seen: list[str]) -> AgentClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["user-agent"])
        return httpx.Response(200, json={"store_id": "x"}, headers={protocol.HEADER: answer} if answer else {})

    url = "http://127.0.0.1:9"
    http = httpx.Client(base_url=url, transport=httpx.MockTransport(handler))
    return AgentClient(url, TOKEN, transport=HttpTransport(url, TOKEN, client=http,
                                                           user_agent=protocol.user_agent(__version__)))


def test_a_client_talks_to_an_agent_of_the_release_before_and_refuses_an_older_one():
    seen: list[str] = []
    with _agent(None, seen) as old:                        # 0.1.0's agents name nothing
        assert old.get_json("/v1/info") == {"store_id": "x"}
        assert old.peer == protocol.Peer(protocol.FIRST, 1)
    assert seen == [f"capsule/{__version__} protocol/{protocol.PROTOCOL}"]
    with _agent("0 capsule/0.0.1", seen) as ancient, pytest.raises(ProtocolMismatch) as err:
        ancient.get_json("/v1/info")
    assert "capsule 0.0.1 (protocol 0)" in str(err.value) and f"capsule {__version__}" in str(err.value)


def test_the_agent_client_names_this_release(monkeypatch):
    made: list[dict] = []

    class Recording(HttpTransport):
        def __init__(self, *a, **kw):
            made.append(kw)
            super().__init__(*a, **kw)

    monkeypatch.setattr("capsule.agentclient.HttpTransport", Recording)
    AgentClient("http://127.0.0.1:9", TOKEN).close()
    assert made[0]["user_agent"] == f"capsule/{__version__} protocol/{protocol.PROTOCOL}"
