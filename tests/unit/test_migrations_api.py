"""The dashboard's migration API on a real agent app: a known peer only, sessions and CSRF, the migration in a
thread with its progress as Server-Sent Events, and a cancel. The migration itself is a stand-in that reports
like capsule.migrate does (its orchestration is tested in test_migrate_progress.py, on guests in
tests/vm/test_migrate_progress.py)."""

from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient

from capsule import hosts
from capsule import migrate as lib
from capsule.agent.app import create_app
from capsule.errors import Cancelled, Conflict
from capsule.migrate.progress import Tracker, planned
from capsule.store import Store
from capsule.store.catalogue import InstanceRow
from tests.helpers.inprocess_agent import InProcessAgent
from tests.unit.test_dashboard_api import PEER_TOKEN, SECRET, TOKEN, home, sign_in  # noqa: F401 - fixture
from tests.wait import wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
OFFLINE = {"to": "office", "live": False, "mode": "full"}     # (a live move is the default)
DEMAND = {"to": "office", "live": False, "mode": "demand"}


class StandIn:
    """In place of capsule.migrate.migrate: reports save and memory, then waits for ``go`` or a cancel."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls: list[dict] = []

    def __call__(self, store, name, to, token, *, mode, balloon, on_event, cancel, to_name, **kw):
        self.calls.append({"name": name, "to": to, "token": token, "to_name": to_name, "mode": mode,
                           "balloon": balloon} | kw)
        t = Tracker(name, to_name, planned(mode, balloon is not None), on_event, min_interval=0)
        t.enter("save")
        t.set_version(f"{name}@2")
        t.totals({"memory": 4096})
        t.object("file", "m", "memory", 4096, False)
        t.advance(1024)
        t.wire(600)
        wait_until(lambda: self.go.is_set() or cancel.cancelled, 20, "neither go nor a cancel came")
        if cancel.cancelled:
            t.finish("cancelled", "source", "cancelled")
            raise lib.MigrationCancelled(f"migrating {name} was cancelled", version=f"{name}@2", step="push",
                                         restored=True, cause=Cancelled("cancelled"))
        cancel.commit()
        t.advance(3072)
        t.enter("resume")
        last = t.finish("done", "destination", "ok")
        return lib.MigrateResult(mode, None, None, {"mode": "restore"}, 1.0, last)  # type: ignore[arg-type]


@pytest.fixture
def world(home, tmp_path, monkeypatch):  # noqa: F811
    """This host (a running capsule, as the catalogue sees it), a peer "office", a signed-in page."""
    peer = InProcessAgent(tmp_path / "b", PEER_TOKEN)
    store = Store.open(home)
    try:
        hosts.add(store, "office", peer.url, PEER_TOKEN)
        with store.catalogue.transaction():
            store.catalogue.add_instance(InstanceRow(SECRET, 1, "capsule-x", [], [[]], "tcg", str(tmp_path)))
    finally:
        store.close()
    stand_in = StandIn()
    monkeypatch.setattr(lib, "migrate", stand_in)
    client = TestClient(create_app(home, TOKEN))
    csrf = sign_in(client)
    yield client, csrf, stand_in, peer
    stand_in.go.set()
    peer.stop()


def _events(client: TestClient, mid: str) -> list[dict]:
    out = []
    with client.stream("GET", f"/api/migrations/{mid}/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: {}":
                out.append(json.loads(line[6:]))
    return out


def test_a_migration_runs_in_the_agent_and_streams_its_phases(world):
    client, csrf, stand_in, peer = world
    r = client.post(f"/api/capsules/{SECRET}/migrate", json=OFFLINE | {"balloon": True},
                    headers={"X-CSRF-Token": csrf})
    assert r.status_code == 202, r.text
    m = r.json()
    assert (m["capsule"], m["to"], m["to_url"], m["mode"]) == (SECRET, "office", peer.url, "full")
    # the destination's URL and token come from the peers table
    wait_until(lambda: stand_in.calls, 10, "the migration never started")
    call = stand_in.calls[0]
    assert (call["to"], call["token"], call["to_name"], call["balloon"]) == (peer.url, PEER_TOKEN, "office", "cache")
    wait_until(lambda: client.get(f"/api/migrations/{m['id']}").json()["progress"]["phase"] == "memory", 10,
               "the memory phase never showed")
    stand_in.go.set()
    events = _events(client, m["id"])
    progress = [e["progress"] for e in events]
    assert [p["seq"] for p in progress] == sorted(set(p["seq"] for p in progress))
    assert progress[-1]["outcome"] == "done" and progress[-1]["where"] == "destination"
    assert progress[-1]["phase"] == "resume" and progress[-1]["done_bytes"] == 4096
    assert events[-1]["remote"] == {"mode": "restore"} and events[-1]["error"] is None
    assert client.get("/api/migrations").json()[0]["id"] == m["id"]


def test_cancel_ends_it_at_the_source(world):
    client, csrf, stand_in, _peer = world
    m = client.post(f"/api/capsules/{SECRET}/migrate", json={"to": "office"}, headers={"X-CSRF-Token": csrf}).json()
    wait_until(lambda: client.get(f"/api/migrations/{m['id']}").json()["progress"]["phase"] == "memory", 10,
               "the memory phase never showed")
    assert client.post(f"/api/migrations/{m['id']}/cancel").status_code == 403  # no CSRF token
    r = client.post(f"/api/migrations/{m['id']}/cancel", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200, r.text
    last = _events(client, m["id"])[-1]
    assert last["progress"]["outcome"] == "cancelled" and last["progress"]["where"] == "source"
    assert last["error"]["error"] == "migration_cancelled" and last["error"]["restored"] is True
    again = client.post(f"/api/migrations/{m['id']}/cancel", headers={"X-CSRF-Token": csrf})
    assert again.status_code == 409 and "already ended" in again.json()["detail"]


def test_only_a_known_peer_a_running_capsule_and_one_migration_at_a_time(world):
    client, csrf, stand_in, _peer = world
    h = {"X-CSRF-Token": csrf}
    r = client.post(f"/api/capsules/{SECRET}/migrate", json={"to": "elsewhere"}, headers=h)
    assert r.status_code == 404 and "no host named 'elsewhere'" in r.json()["detail"]
    r = client.post(f"/api/capsules/{SECRET}/migrate", json={"to": "office", "url": "http://evil.example"},
                    headers=h)
    assert r.status_code in (400, 422)  # no URL from the page
    assert client.post("/api/capsules/nope/migrate", json={"to": "office"}, headers=h).status_code == 404
    assert client.post(f"/api/capsules/{SECRET}/migrate", json={"to": "office"}).status_code == 403
    assert client.post(f"/api/capsules/{SECRET}/migrate", json={"to": "office"}, headers=h).status_code == 202
    r = client.post(f"/api/capsules/{SECRET}/migrate", json={"to": "office"}, headers=h)
    assert r.status_code == 409 and "already being migrated" in r.json()["detail"]
    assert client.get("/api/migrations/0123abcd").status_code == 404
    assert len(stand_in.calls) <= 1


def test_without_a_session_nothing_is_revealed(world):
    client, _csrf, _stand_in, _peer = world
    anon = TestClient(client.app)
    for method, path in [("POST", f"/api/capsules/{SECRET}/migrate"), ("GET", "/api/migrations"),
                         ("GET", "/api/migrations/x"), ("GET", "/api/migrations/x/events"),
                         ("POST", "/api/migrations/x/cancel")]:
        r = anon.request(method, path, json={"to": "office"} if method == "POST" else None)
        assert r.status_code == 401 and SECRET not in r.text and "office" not in r.text


PUBLIC = "https://work.example:7070"


def test_demand_mode_gives_the_other_host_this_agents_configured_url_never_the_requests(world):
    """The source URL the destination reads the disks from (and sends its token to) is the one `capsule serve`
    was configured with; a forged Host header or X-Forwarded-Proto (uvicorn believes the latter from loopback
    by default) changes nothing."""
    client, csrf, stand_in, _peer = world
    client.app.state.public_url = PUBLIC            # what `capsule serve --public-url` sets
    forged = {"X-CSRF-Token": csrf, "Host": "evil.example:1", "X-Forwarded-Proto": "http",
              "X-Forwarded-Host": "evil.example:1", "X-Forwarded-For": "127.0.0.1"}
    r = client.post(f"/api/capsules/{SECRET}/migrate", json=DEMAND, headers=forged)
    assert r.status_code == 202, r.text
    wait_until(lambda: stand_in.calls, 10, "the migration never started")
    assert stand_in.calls[0]["source_url"] == PUBLIC
    assert stand_in.calls[0]["source_token"] == TOKEN


def test_demand_mode_without_a_public_url_is_refused_and_starts_nothing(world):
    """An agent listening on every address (0.0.0.0) has no URL of its own unless --public-url gives one: a
    demand migration is refused with what to do, rather than guessed from the request; full mode still runs."""
    client, csrf, stand_in, _peer = world
    client.app.state.public_url = None
    h = {"X-CSRF-Token": csrf}
    r = client.post(f"/api/capsules/{SECRET}/migrate", json=DEMAND, headers=h)
    assert r.status_code == 409 and "--public-url" in r.json()["detail"], r.text
    assert client.get("/api/migrations").json() == [] and not stand_in.calls
    assert client.post(f"/api/capsules/{SECRET}/migrate", json={"to": "office"}, headers=h).status_code == 202


def test_once_accounts_exist_demand_mode_hands_out_a_read_grant_for_the_capsule(world, home):  # noqa: F811
    """The old token is retired by the first admin: the other host pages the disks in with a grant of this host
    to read that capsule's objects and nothing else, made by the user who started the migration (and an owner
    migrates only its own capsule)."""
    from capsule.accounts import owners, tokens, users

    client, _csrf, stand_in, _peer = world
    client.app.state.public_url = PUBLIC
    store = Store.open(home)
    users.add(store, "root", "admin")
    users.add(store, "alice", "owner")
    _, alice = tokens.create(store, "alice", "read,capsules")
    auth = {"Authorization": f"Bearer {alice}"}
    r = client.post(f"/api/capsules/{SECRET}/migrate", json=DEMAND, headers=auth)
    assert r.status_code == 403 and r.json()["error"] == "forbidden" and not stand_in.calls
    owners.set_owner(store, SECRET, "alice")
    r = client.post(f"/api/capsules/{SECRET}/migrate", json=DEMAND, headers=auth)
    assert r.status_code == 202, r.text
    wait_until(lambda: stand_in.calls, 10, "the migration never started")
    grant = stand_in.calls[0]["source_token"]
    assert grant != TOKEN
    p = tokens.resolve(store, grant, TOKEN)
    assert p.user == tokens.HOST_USER and p.grant is not None and p.grant.describe() == f"read {SECRET}"
    assert (p.grant.issuer, p.grant.issuer_token) == ("alice", alice.split("_")[1])
    g = {"Authorization": f"Bearer {grant}"}
    ours = store.catalogue.latest_version(SECRET).chains[0][-1]
    assert client.get(f"/v1/objects/layer/{ours}", headers=g).status_code == 404     # HCP: allowed (absent)
    assert client.get(f"/v1/objects/layer/{'ab' * 32}", headers=g).status_code == 403  # not this capsule's
    assert client.post(f"/v1/capsules/{SECRET}/stop", headers=g).status_code == 403
    assert [m["capsule"] for m in client.get("/api/migrations", headers=auth).json()] == [SECRET]
    # cancelled, it runs here again: the other host never runs it, and its grant ends at once
    assert client.post(f"/api/migrations/{r.json()['id']}/cancel", headers=auth).status_code == 200
    wait_until(lambda: tokens.get(store, p.token_id).state() == "revoked", 10, "the grant outlived the migration")
    assert client.get(f"/v1/objects/layer/{ours}", headers=g).status_code == 401
    store.close()


def test_an_owners_migration_counts_against_its_limit_until_it_ends(world, home, monkeypatch):  # noqa: F811
    """A migration runs in its own thread after the answer: it is one of its owner's operations under way until it
    ends (capsule/agent/workers.py), so an owner cannot run more at once by migrating."""
    from capsule import capsules, lifecycle
    from capsule.accounts import owners, tokens, users

    client, _csrf, stand_in, _peer = world
    store = Store.open(home)
    capsules.create(store, "second", "img", memory="256M")
    with store.catalogue.transaction():
        store.catalogue.add_instance(InstanceRow("second", 1, "capsule-y", [], [[]], "tcg", str(home)))
    users.add(store, "alice", "owner")
    owners.set_owner(store, SECRET, "alice")
    owners.set_owner(store, "second", "alice")
    auth = {"Authorization": f"Bearer {tokens.create(store, 'alice', 'read,capsules')[1]}"}
    store.close()
    started: list[str] = []

    def start(_store: Store, ref: str, **_kw: object) -> None:
        started.append(ref)
        raise Conflict(f"{ref} is a stand-in's: not started")

    monkeypatch.setattr(lifecycle, "start", start)
    for name in (SECRET, "second"):
        r = client.post(f"/api/capsules/{name}/migrate", json={"to": "office"}, headers=auth)
        assert r.status_code == 202, r.text
    r = client.post(f"/api/capsules/{SECRET}/start", json={}, headers=auth)
    assert r.status_code == 429 and r.json()["error"] == "too_many_operations" and r.headers["Retry-After"]
    assert not started                                   # refused before anything ran
    stand_in.go.set()
    wait_until(lambda: all(m["progress"]["outcome"] == "done" for m in client.get("/api/migrations").json()), 10,
               "the migrations to end")
    wait_until(lambda: client.post(f"/api/capsules/{SECRET}/start", json={}, headers=auth).status_code == 409, 10,
               "the owner's count to come back")
    assert started == [SECRET]
