"""The dashboard API on a real agent app and a real store without guests: sign-in, sessions that
expire, CSRF, 401s that reveal nothing, the capsule list, the peers, and the CLI's refusals as HTTP
errors."""

from __future__ import annotations

import time
import uuid

import pytest
from fastapi.testclient import TestClient

from capsule import capsules, hosts, views
from capsule.agent.app import create_app
from capsule.lifecycle import demand
from capsule.store import Store
from capsule.store.catalogue import ImageRow
from tests.helpers.inprocess_agent import InProcessAgent

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN = "the-host-token-0123456789abcdef"
PEER_TOKEN = "the-peer-token-0123456789abcdef"
SECRET = "secret-desktop"


def _fake_image(store: Store, name: str = "img") -> ImageRow:
    """A catalogue image whose objects are not on disk: enough for create/derive/ls/rm (no guest runs)."""
    row = ImageRow(name=name, kind="tiny", root_layer=uuid.uuid4().hex * 2, kernel=uuid.uuid4().hex * 2,
                   initrd=uuid.uuid4().hex * 2, cmdline="console=ttyS0", marker="READY", info={},
                   created=time.time())
    store.catalogue.add_image(row)
    return row


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def home(tmp_path):
    store = Store.open(tmp_path / "a")
    _fake_image(store)
    capsules.create(store, SECRET, "img", memory="256M")
    store.close()
    return tmp_path / "a"


@pytest.fixture
def app(home):
    app = create_app(home, TOKEN)
    app.state.sessions.clock = Clock()
    return app


@pytest.fixture
def client(app):
    return TestClient(app)


def sign_in(client: TestClient) -> str:
    r = client.post("/api/session", json={"token": TOKEN})
    assert r.status_code == 200, r.text
    return r.json()["csrf"]


ROUTES = [("GET", "/api/capsules"), ("GET", "/api/hosts"), ("GET", "/api/tree"),
          ("GET", "/api/session"), ("DELETE", "/api/session"),
          ("POST", f"/api/capsules/{SECRET}/start"), ("POST", f"/api/capsules/{SECRET}/stop"),
          ("POST", f"/api/capsules/{SECRET}/suspend"), ("POST", f"/api/capsules/{SECRET}/snapshot"),
          ("POST", f"/api/capsules/{SECRET}/derive"), ("POST", f"/api/capsules/{SECRET}/rm"),
          ("GET", f"/api/capsules/{SECRET}"), ("GET", "/api/no-such-call"),
          ("GET", "/api/backups"), ("POST", f"/api/backups/{SECRET}/run"), ("POST", f"/api/backups/{SECRET}/restore"),
          ("POST", "/api/backups/verify")]


def _assert_bare_401(r) -> None:
    assert r.status_code == 401
    assert SECRET not in r.text and "img" not in r.text
    assert r.json() == {"error": "auth_failed", "detail": "sign in first (or send the host's token as a bearer token)"}


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_unauthenticated_calls_get_401_revealing_nothing(client, method, path):
    _assert_bare_401(client.request(method, path, json={"child": "x"}))
    _assert_bare_401(client.request(method, path, json={}, headers={"Authorization": "Bearer wrong-token-000000"}))
    _assert_bare_401(client.request(method, path, cookies={client.app.state.sessions.cookie: "made-up"}))


def test_wrong_token_does_not_sign_in(client):
    r = client.post("/api/session", json={"token": TOKEN[:-1] + "X"})
    assert r.status_code == 401 and "set-cookie" not in r.headers
    assert client.get("/api/capsules").status_code == 401
    assert client.post("/api/session", json={}).status_code == 400


def test_sign_in_cookie_and_session(client, app):
    r = client.post("/api/session", json={"token": TOKEN})
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{app.state.sessions.cookie}=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Secure" not in cookie
    assert r.headers["cache-control"] == "no-store"
    body = r.json()
    assert body["csrf"] and body["csrf"] not in cookie and body["expires_in"] > 60
    assert client.get("/api/session").json()["csrf"] == body["csrf"]
    assert [c["name"] for c in client.get("/api/capsules").json()] == [SECRET]


def test_cookie_is_secure_over_https(app):
    c = TestClient(app, base_url="https://testserver")
    r = c.post("/api/session", json={"token": TOKEN})
    assert "Secure" in r.headers["set-cookie"]


def test_session_expires_when_idle_and_after_its_lifetime(client, app):
    sessions, clock = app.state.sessions, app.state.sessions.clock
    sign_in(client)
    clock.now += sessions.idle - 1
    assert client.get("/api/capsules").status_code == 200      # used: the idle timer restarts
    clock.now += sessions.idle - 1
    assert client.get("/api/capsules").status_code == 200
    clock.now += sessions.idle + 1
    _assert_bare_401(client.get("/api/capsules"))
    # kept busy, a session still ends after its lifetime
    sign_in(client)
    start = clock.now
    while clock.now - start < sessions.lifetime - sessions.idle:
        clock.now += sessions.idle / 2
        assert client.get("/api/session").status_code == 200
    clock.now = start + sessions.lifetime
    _assert_bare_401(client.get("/api/session"))


def test_sign_out_ends_the_session(client):
    csrf = sign_in(client)
    assert client.delete("/api/session").status_code == 403            # CSRF: sign-out is a change too
    assert client.delete("/api/session", headers={"X-CSRF-Token": csrf}).status_code == 204
    _assert_bare_401(client.get("/api/capsules"))


def test_state_changes_need_the_csrf_token(client, home):
    csrf = sign_in(client)
    path = f"/api/capsules/{SECRET}/derive"
    for headers in ({}, {"X-CSRF-Token": "wrong"}, {"X-CSRF-Token": ""},
                    {"X-CSRF-Token": csrf, "Origin": "http://evil.example"},
                    {"X-CSRF-Token": csrf, "Sec-Fetch-Site": "cross-site"}):
        r = client.post(path, json={"child": "child"}, headers=headers)
        assert r.status_code == 403, headers
        assert SECRET not in r.text
    store = Store.open(home)
    assert store.catalogue.capsule("child") is None                     # nothing happened
    r = client.post(path, json={"child": "child"}, headers={"X-CSRF-Token": csrf, "Origin": "http://testserver",
                                                            "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 200, r.text
    assert r.json()["ref"] == "child@1" and r.json()["parent"] == f"{SECRET}@1"
    assert store.catalogue.capsule("child") is not None
    store.close()


def test_cross_site_sign_in_is_refused(client):
    r = client.post("/api/session", json={"token": TOKEN}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "set-cookie" not in r.headers


def test_bearer_token_needs_no_csrf(client, home):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = client.post(f"/api/capsules/{SECRET}/derive", json={"child": "kid"}, headers=auth)
    assert r.status_code == 200, r.text
    assert client.get("/api/session", headers=auth).json()["csrf"] is None
    r = client.post("/api/capsules/kid/rm", json={}, headers=auth)
    assert r.status_code == 200 and r.json()["removed"] == ["kid@1"]


def test_refusals_are_http_errors(client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases = [
        (f"/api/capsules/{SECRET}/derive", {"child": SECRET}, 409, "already exists"),
        (f"/api/capsules/{SECRET}/derive", {"child": "../x"}, 400, "invalid capsule name"),
        (f"/api/capsules/{SECRET}/derive", {"child": "y", "version": 7}, 404, "has no version 7"),
        ("/api/capsules/ghost/start", {}, 404, "no capsule named 'ghost'"),
        (f"/api/capsules/{SECRET}/suspend", {}, 409, "is not running"),
        (f"/api/capsules/{SECRET}/snapshot", {"balloon": True}, 409, "is not running"),
        (f"/api/capsules/{SECRET}/start", {"version": 0}, 400, "version: 0 is not a whole number from 1 to"),
        (f"/api/capsules/{SECRET}/suspend", {"balloon_policy": "rm -rf"}, 400, "balloon_policy"),
        (f"/api/capsules/{SECRET}/rm", {"version": 3}, 404, "has no version 3"),
        ("/api/capsules/bad%20name/rm", {}, 400, "invalid capsule name"),
    ]
    for path, body, status, needle in cases:
        r = client.post(path, json=body, headers=auth)
        assert r.status_code == status, (path, body, r.text)
        assert needle in r.text, (path, r.text)


def test_capsule_list_shows_state_versions_sizes_and_dependencies(client, home, tmp_path):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    store = Store.open(home)
    peer = InProcessAgent(tmp_path / "b", PEER_TOKEN)
    try:
        hosts.add(store, "office", peer.url, PEER_TOKEN)
        # the capsule's root layer is paged in from the peer: only its remote record is here
        layer = store.catalogue.latest_version(SECRET).chains[0][0]
        demand.remote_dir(store).mkdir(parents=True, exist_ok=True)
        demand.remote_info_path(store, layer).write_text(f'{{"url": "{peer.url}"}}')
        (c,) = client.get("/api/capsules", headers=auth).json()
    finally:
        peer.stop()
        store.close()
    assert (c["name"], c["state"], c["latest"], c["version_count"], c["domain"]) == (SECRET, "stopped", 1, 1, None)
    (v,) = c["versions"]
    assert v["ref"] == f"{SECRET}@1" and v["active"] is False and v["memory"] is None
    assert v["depends_on"] == [{"url": peer.url, "host": "office"}]
    assert v["disks"][0][0]["remote"]["url"] == peer.url
    assert v["config"]["memory_mib"] == 256


def test_tree_is_what_the_cli_prints_and_follows_a_derive(client, home):
    """GET /api/tree answers the one builder's graph (capsule tree --json prints the same) and changes with
    the catalogue: a derived child's version is on the same top layer as its parent's."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    store = Store.open(home)
    try:
        before = client.get("/api/tree", headers=auth).json()
        assert before == views.tree_dict(store)
        assert [v["ref"] for v in before["versions"]] == [f"{SECRET}@1"]
        assert client.post(f"/api/capsules/{SECRET}/derive", json={"child": "kid"}, headers=auth).status_code == 200
        after = client.get("/api/tree", headers=auth).json()
        assert after == views.tree_dict(store)
    finally:
        store.close()
    v = {x["ref"]: x for x in after["versions"]}
    assert set(v) == {f"{SECRET}@1", "kid@1"} and v["kid@1"]["parent"] == f"{SECRET}@1"
    assert v["kid@1"]["tops"] == v[f"{SECRET}@1"]["tops"]
    assert {c["name"]: c["parent"] for c in after["capsules"]} == {SECRET: None, "kid": f"{SECRET}@1"}
    assert after["images"] == [{"name": "img", "kind": "tiny", "root_layer": v["kid@1"]["chains"][0][0]}]


def test_hosts_lists_peers_with_their_capsules_and_marks_a_dead_one(client, home, tmp_path):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    store = Store.open(home)
    peer = InProcessAgent(tmp_path / "b", PEER_TOKEN)
    gone = InProcessAgent(tmp_path / "c", PEER_TOKEN)
    try:
        pstore = Store.open(tmp_path / "b")
        _fake_image(pstore)
        capsules.create(pstore, "on-b", "img")
        pstore.close()
        hosts.add(store, "b", peer.url, PEER_TOKEN)
        hosts.add(store, "c", gone.url, PEER_TOKEN)
        gone.stop()
        b, c = client.get("/api/hosts", headers=auth).json()
    finally:
        peer.stop()
        gone.stop()
        store.close()
    assert (b["name"], b["reachable"], b["error"]) == ("b", True, None)
    assert [x["name"] for x in b["capsules"]] == ["on-b"] and b["capsules"][0]["state"] == "stopped"
    assert (c["name"], c["reachable"], c["capsules"]) == ("c", False, None)
    assert "cannot reach" in c["error"]
    assert PEER_TOKEN not in str(b) + str(c)


def test_openapi_documents_the_api(client):
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for path in ("/api/session", "/api/capsules", "/api/hosts", "/api/capsules/{name}/start",
                 "/api/capsules/{name}/rm"):
        assert path in paths
    ok = paths["/api/capsules"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok["items"]["$ref"].endswith("/CapsuleOut")
    assert "VersionDetail" in spec["components"]["schemas"]


def test_page_is_served_without_a_session_and_reveals_nothing(client):
    r = client.get("/")
    assert r.status_code == 200 and "<title>Capsule</title>" in r.text
    assert SECRET not in r.text
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert client.get("/web/js/app.js").status_code == 200
    assert client.get("/web/../capsule/hosts.py").status_code == 404


def test_backups_panel_data_and_refusals(client, home):
    """GET /api/backups: each schedule with its backups (newest first) and the verify job; a run, a restore
    and a verify refuse bad input as the CLI does, and change nothing."""
    from capsule.backup import jobs, verifyjob
    from capsule.backup.retention import Policy

    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.get("/api/backups", headers=auth).json() == {"jobs": [], "verify": None}
    store = Store.open(home)
    try:
        jobs.schedule(store, SECRET, "daily", Policy(daily=7))
        verifyjob.schedule(store, "Sun 04:00")
    finally:
        store.close()
    data = client.get("/api/backups", headers=auth).json()
    [job] = data["jobs"]
    assert job["capsule"] == SECRET and job["policy_text"] == "keep-daily 7" and job["backups"] == []
    assert data["verify"]["calendar"] == "Sun 04:00" and data["verify"]["last_result"] is None
    csrf = sign_in(client)
    r = client.post("/api/backups/ghost/run", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 404 and "no backup schedule" in r.json()["detail"]
    r = client.post(f"/api/backups/{SECRET}/restore", json={"version": 9}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 404 and "has no version 9" in r.json()["detail"]
    r = client.post(f"/api/backups/{SECRET}/restore", json={"version": 1, "as_name": "../x"},
                    headers={"X-CSRF-Token": csrf})
    assert r.status_code == 400
    r = client.post(f"/api/backups/{SECRET}/restore", json={"version": 0}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 400
    assert client.post(f"/api/backups/{SECRET}/run").status_code == 403        # no CSRF token
    r = client.post("/api/backups/verify", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200 and r.json()["ok"] and r.json()["hosts"][0]["backups"] == []
    store = Store.open(home)
    try:
        assert [v.ref for v in store.catalogue.versions(SECRET)] == [f"{SECRET}@1"]
        assert [c.name for c in store.catalogue.capsules()] == [SECRET]
    finally:
        store.close()
