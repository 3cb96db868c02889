"""Bring here on real agent apps: this host (A) asks a peer's agent (B, on uvicorn in a thread) to migrate its
capsule to A as B knows it, follows that migration's phases through A and cancels it through A; and every
refusal (an unknown peer, a peer that does not know A, an unknown capsule, a caller without the right, a peer
token that may not start moves there) changes nothing. B's migration is the stand-in of test_migrations_api."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from capsule import capsules, hosts
from capsule import migrate as lib
from capsule.accounts import tokens, users
from capsule.agent.app import create_app
from capsule.store import Store
from capsule.store.catalogue import InstanceRow
from tests.helpers.inprocess_agent import InProcessAgent
from tests.unit.test_dashboard_api import PEER_TOKEN, TOKEN, _fake_image, home, sign_in  # noqa: F401 - fixture
from tests.unit.test_migrations_api import StandIn
from tests.wait import wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
BRING = "/api/hosts/office/capsules/desk/bring"


@pytest.fixture
def world(home, tmp_path, monkeypatch):  # noqa: F811
    """A (its agent, and a signed-in page on it) with B known as "office"; B runs "desk" (as its catalogue sees
    it). B does not know A yet: ``know_a()`` adds it there as "home"."""
    b_home = tmp_path / "b"
    b = Store.open(b_home)
    _fake_image(b)
    capsules.create(b, "desk", "img", memory="256M")
    b.catalogue.add_instance(InstanceRow("desk", 1, "capsule-desk", [], [[]], "tcg", str(tmp_path)))
    b.close()
    agent_b = InProcessAgent(b_home, PEER_TOKEN)
    agent_a = InProcessAgent(home, TOKEN)
    a = Store.open(home)
    hosts.add(a, "office", agent_b.url, PEER_TOKEN)
    a.close()
    stand_in = StandIn()
    monkeypatch.setattr(lib, "migrate", stand_in)
    client = TestClient(create_app(home, TOKEN))
    csrf = sign_in(client)

    def know_a() -> None:
        s = Store.open(b_home)
        try:
            hosts.add(s, "home", agent_a.url, TOKEN)
        finally:
            s.close()

    yield client, {"X-CSRF-Token": csrf}, stand_in, agent_a, know_a
    stand_in.go.set()
    agent_a.stop()
    agent_b.stop()


def test_bring_here_starts_the_peers_move_to_this_host_and_follows_it(world):
    client, h, stand_in, agent_a, know_a = world
    know_a()
    check = client.get(f"{BRING}/check")
    assert check.status_code == 200, check.text
    assert check.json()["to"] == "home" and check.json()["refused"] is None
    r = client.post(BRING, json={"live": False, "mode": "full"}, headers=h)
    assert r.status_code == 202, r.text
    m = r.json()
    assert (m["host"], m["capsule"], m["to"], m["to_url"], m["mode"]) == ("office", "desk", "home", agent_a.url,
                                                                          "full")
    # B moves it to A at the URL and with the token of B's own peers table
    wait_until(lambda: stand_in.calls, 10, "B's migration never started")
    call = stand_in.calls[0]
    assert (call["name"], call["to"], call["token"], call["to_name"]) == ("desk", agent_a.url, TOKEN, "home")
    wait_until(lambda: client.get(f"/api/hosts/office/migrations/{m['id']}").json()["progress"]["phase"]
               == "memory", 10, "the memory phase never showed through A")
    stand_in.go.set()
    with client.stream("GET", f"/api/hosts/office/migrations/{m['id']}/events") as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        progress = [line for line in s.iter_lines() if line.startswith("data: ") and line != "data: {}"]
    last = json.loads(progress[-1][6:])["progress"]
    assert last["outcome"] == "done" and last["where"] == "destination"
    phases = [json.loads(p[6:])["progress"]["phase"] for p in progress]
    assert [p for i, p in enumerate(phases) if p and p not in phases[:i]] == ["save", "memory", "resume"], phases


def test_cancel_through_this_host_leaves_it_on_the_peer(world):
    client, h, stand_in, _a, know_a = world
    know_a()
    m = client.post(BRING, json={}, headers=h).json()         # live by default
    assert m["mode"] == "live"
    wait_until(lambda: stand_in.calls, 10, "B's migration never started")
    assert client.post(f"/api/hosts/office/migrations/{m['id']}/cancel").status_code == 403   # no CSRF token
    r = client.post(f"/api/hosts/office/migrations/{m['id']}/cancel", headers=h)
    assert r.status_code == 200, r.text
    wait_until(lambda: client.get(f"/api/hosts/office/migrations/{m['id']}").json()["progress"]["outcome"]
               == "cancelled", 10, "the cancel never showed through A")
    end = client.get(f"/api/hosts/office/migrations/{m['id']}").json()
    assert end["progress"]["where"] == "source" and end["error"]["error"] == "migration_cancelled"
    assert client.get("/api/hosts/office/migrations/0123abcd").status_code == 404
    assert client.get("/api/hosts/office/migrations/0123abcd/events").status_code == 404


def test_refusals_change_nothing(world, home):  # noqa: F811
    client, h, stand_in, _a, know_a = world
    r = client.post("/api/hosts/nowhere/capsules/desk/bring", json={}, headers=h)
    assert r.status_code == 404 and "no host named 'nowhere'" in r.json()["detail"]
    # B does not know A: refused, naming what to add there
    r = client.post(BRING, json={}, headers=h)
    assert r.status_code == 409 and "capsule host add" in r.json()["detail"], r.text
    assert "host office does not know this host" in r.json()["detail"]
    check = client.get(f"{BRING}/check").json()
    assert check["refused"]["reason"] == "unknown_destination" and check["to"] is None
    know_a()
    r = client.post("/api/hosts/office/capsules/nope/bring", json={}, headers=h)
    assert r.status_code == 404 and "no capsule named 'nope'" in r.json()["detail"], r.text
    assert client.post(BRING, json={"to": "elsewhere"}, headers=h).status_code in (400, 422)     # the destination is A
    r = client.post(BRING, json={"live": True, "mode": "demand"}, headers=h)
    assert r.status_code == 400, r.text
    assert client.post(BRING, json={}).status_code == 403                                   # no CSRF token
    # an owner of A may not: A acts on B with its own token for B
    a = Store.open(home)
    try:
        users.add(a, "alice", "owner")
        _t, secret = tokens.create(a, "alice", ["read", "capsules"])
    finally:
        a.close()
    r = client.post(BRING, json={}, headers={"Authorization": f"Bearer {secret}"})
    assert r.status_code == 403 and "operators" in r.json()["detail"], r.text
    assert client.get(f"{BRING}/check", headers={"Authorization": f"Bearer {secret}"}).status_code == 403
    assert stand_in.calls == []


def test_a_host_token_for_the_peer_cannot_start_a_move_there(world, tmp_path):
    """A holds a ``host``-scoped token for B (what one agent gives another): B refuses to start the move."""
    client, h, stand_in, agent_a, _know_a = world
    b = Store.open(tmp_path / "b")
    try:
        users.add(b, "root", "admin")
        users.add(b, "peer-a", "operator")
        _t, host_only = tokens.create(b, "peer-a", ["host"])
        hosts.add(b, "home", agent_a.url, TOKEN)
    finally:
        b.close()
    a = Store.open(tmp_path / "a")
    try:
        office = hosts.remove(a, "office")
        hosts.add(a, "office", office.url, host_only)
    finally:
        a.close()
    r = client.post(BRING, json={"live": False, "mode": "full"}, headers=h)
    assert r.status_code == 403 and "scope" in r.json()["detail"], r.text
    assert stand_in.calls == []


def test_a_peers_hierarchy_through_this_host(world, home):  # noqa: F811
    """Which versions exist where: a peer's tree, asked of it through this host (staff only, as the relay)."""
    client, _h, _stand_in, _a, _know_a = world
    r = client.get("/api/hosts/office/tree")
    assert r.status_code == 200, r.text
    tree = r.json()
    assert [c["name"] for c in tree["capsules"]] == ["desk"]
    assert {v["ref"] for v in tree["versions"]} == {"desk@1"}
    assert tree["store_id"] != client.get("/api/tree").json()["store_id"]
    r = client.get("/api/hosts/nowhere/tree")
    assert r.status_code == 404 and "no host named 'nowhere'" in r.json()["detail"]
    a = Store.open(home)
    try:
        users.add(a, "alice", "owner")
        _t, secret = tokens.create(a, "alice", ["read", "capsules"])
    finally:
        a.close()
    assert client.get("/api/hosts/office/tree", headers={"Authorization": f"Bearer {secret}"}).status_code == 403


def test_a_peers_event_stream_is_not_asked_for_in_clear_across_a_network(home):  # noqa: F811
    """The event relay opens its own connection to the peer: like every other call, it refuses to send this
    host's token for the peer over plain HTTP to another machine, before connecting."""
    import asyncio

    from capsule.migrate import bring
    from hashcache.errors import InsecureTransport

    a = Store.open(home)
    try:
        a.catalogue.query("INSERT INTO peers(name, url, token, store_id, added, fingerprint) VALUES(?,?,?,?,?,?)",
                          ("far", "http://far.example:7070", PEER_TOKEN, "f00dfeed", 0.0, None))
        with pytest.raises(InsecureTransport):
            asyncio.run(bring.events(a, "far", "abc123"))
    finally:
        a.close()
