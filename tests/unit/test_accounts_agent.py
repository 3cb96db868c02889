"""Accounts on a real agent app and store (no guests): the old host token until the first admin, user tokens and
their scopes, owners who see and act on only their capsules, host-only tokens for HCP (also over the block
stream) but nothing else, password sign-in bounded per address and user, the audit line of every change
(allowed or refused) and none for a look, and bad input refused with a clear error, changing nothing."""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse

from capsule import audit, capsules
from capsule.accounts import owners, passwords, tokens, users
from capsule.agent.app import create_app
from capsule.agent.sessions import Attempts
from capsule.errors import AlreadyExists, Conflict, InvalidName, NotFound, TooManyAttempts
from capsule.store import Store
from capsule.store.catalogue import ImageRow

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN = "the-host-token-0123456789abcdef"
SECRET = "alices-desk"
OTHER = "bobs-desk"
PASSWORD = "correct horse battery"


def make_home(root: Path) -> Path:
    store = Store.open(root / "store")
    store.catalogue.add_image(ImageRow(name="img", kind="tiny", root_layer=uuid.uuid4().hex * 2,
                                       kernel=uuid.uuid4().hex * 2, initrd=uuid.uuid4().hex * 2,
                                       cmdline="console=ttyS0", marker="READY", info={}, created=time.time()))
    capsules.create(store, SECRET, "img", memory="256M")
    capsules.create(store, OTHER, "img", memory="256M")
    store.close()
    return root / "store"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def world(tmp_path):
    home = make_home(tmp_path)
    app = create_app(home, TOKEN)
    app.state.sign_in_attempts.clock = Clock()
    store = Store.open(home)
    yield app, store, TestClient(app)
    store.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def accounts(store: Store) -> dict[str, str]:
    """An admin, an operator, two owners (alice owns SECRET, bob OTHER) and their tokens; a host-only token."""
    users.add(store, "root", "admin", PASSWORD)
    users.add(store, "ops", "operator")
    users.add(store, "alice", "owner", PASSWORD)
    users.add(store, "bob", "owner")
    owners.set_owner(store, SECRET, "alice")
    owners.set_owner(store, OTHER, "bob")
    return {"admin": tokens.create(store, "root", "read,capsules,host,admin")[1],
            "operator": tokens.create(store, "ops", ["read", "capsules"])[1],
            "alice": tokens.create(store, "alice", "read,capsules")[1],
            "bob": tokens.create(store, "bob", "read,capsules")[1],
            "host": tokens.create(store, "ops", "host")[1]}


def lines(store: Store) -> list[dict]:
    return list(audit.entries(store.home))


def test_the_host_token_works_until_the_first_admin_then_says_what_to_use(world):
    app, store, client = world
    assert client.get("/v1/info", headers=bearer(TOKEN)).status_code == 200
    assert client.get("/api/capsules", headers=bearer(TOKEN)).status_code == 200
    users.add(store, "ops", "operator")          # not an admin: the old token still works
    assert client.get("/v1/info", headers=bearer(TOKEN)).status_code == 200
    csrf = client.post("/api/session", json={"token": TOKEN}).json()["csrf"]   # a session made with it
    users.add(store, "root", "admin", PASSWORD)
    for path in ("/v1/info", "/api/capsules"):
        r = client.get(path, headers=bearer(TOKEN))
        assert r.status_code == 401 and r.json() == {"error": "auth_failed", "detail": tokens.LEGACY_GONE}
    assert client.get("/api/capsules").status_code == 401                       # the session ended with it
    assert client.post(f"/api/capsules/{SECRET}/derive", json={"child": "x"}, headers={"X-CSRF-Token": csrf}
                       ).status_code == 401
    r = client.post("/api/session", json={"token": TOKEN})
    assert r.status_code == 401 and "capsule token create" in r.json()["detail"] and "set-cookie" not in r.headers
    _, secret = tokens.create(store, "root", "admin,read")
    assert client.get("/v1/info", headers=bearer(secret)).status_code == 200


def test_owners_see_and_act_on_only_their_capsules(world):
    app, store, client = world
    t = accounts(store)
    names = lambda path, who: sorted(c["name"] for c in client.get(path, headers=bearer(t[who])).json())  # noqa: E731
    assert names("/api/capsules", "alice") == [SECRET]
    assert names("/v1/capsules", "alice") == [SECRET]
    assert names("/api/capsules", "bob") == [OTHER]
    assert names("/api/capsules", "operator") == sorted([SECRET, OTHER])
    assert client.get("/api/hosts", headers=bearer(t["alice"])).json() == []
    assert client.get(f"/v1/capsules/{OTHER}/versions/latest", headers=bearer(t["alice"])).status_code == 403
    assert client.get(f"/v1/capsules/{SECRET}/versions/latest", headers=bearer(t["alice"])).status_code == 200
    # acting on another's capsule: 403, typed, nothing done
    r = client.post(f"/api/capsules/{OTHER}/derive", json={"child": "stolen"}, headers=bearer(t["alice"]))
    assert r.status_code == 403 and r.json()["error"] == "forbidden" and "not yours" in r.json()["detail"]
    assert store.catalogue.capsule("stolen") is None
    # on their own: allowed, and what they derive is theirs
    r = client.post(f"/api/capsules/{SECRET}/derive", json={"child": "alices-kid"}, headers=bearer(t["alice"]))
    assert r.status_code == 200, r.text
    assert owners.owner_of(store, "alices-kid") == "alice"
    assert "alices-kid" in names("/api/capsules", "alice") and "alices-kid" not in names("/api/capsules", "bob")
    # an operator acts on any capsule; the tree is for operators and admins
    assert client.post(f"/api/capsules/{OTHER}/derive", json={"child": "ops-kid"},
                       headers=bearer(t["operator"])).status_code == 200
    assert client.get("/api/tree", headers=bearer(t["alice"])).status_code == 403
    assert client.get("/api/tree", headers=bearer(t["operator"])).status_code == 200


def test_a_removed_and_remade_capsule_has_no_owner(world):
    _, store, _ = world
    users.add(store, "alice", "owner")
    owners.set_owner(store, SECRET, "alice")
    assert owners.owned_by(store, "alice") == {SECRET}
    from capsule import hierarchy
    hierarchy.rm(store, SECRET)
    capsules.create(store, SECRET, "img", memory="256M")
    assert owners.owner_of(store, SECRET) is None and owners.owned_by(store, "alice") == set()


def test_a_host_token_does_hcp_and_push_but_not_start_stop_or_users(world):
    _, store, client = world
    t = accounts(store)
    h = bearer(t["host"])
    oid = "ab" * 32
    r = client.get(f"/v1/objects/layer/{oid}", headers=h)
    assert r.status_code == 404 and r.json()["error"] == "not_found"             # allowed: the object is absent
    assert client.post("/v1/objects/missing", json={"layers": [oid]}, headers=h).json() == {"layers": [oid],
                                                                                            "files": []}
    with client.websocket_connect("/v1/objects/stream", headers=h) as ws:       # demand paging's block stream
        ws.send_bytes(b"\x00")
        assert ws.receive_bytes()[:1] != b"\x00"                                 # a refusal, as a reply
    for method, path in (("POST", f"/v1/capsules/{SECRET}/start"), ("POST", f"/v1/capsules/{SECRET}/stop"),
                         ("POST", f"/api/capsules/{SECRET}/stop"), ("GET", "/api/tree"),
                         ("POST", "/v1/run")):
        r = client.request(method, path, headers=h, json={})
        assert r.status_code == 403 and r.json()["error"] == "forbidden", (method, path, r.text)
        assert "scope" in r.json()["detail"]
    assert client.get("/api/capsules", headers=h).status_code == 200        # a peer's dashboard lists them
    for who in ("alice", "operator"):       # HCP needs the host scope
        assert client.get(f"/v1/objects/layer/{oid}", headers=bearer(t[who])).status_code == 403
        with pytest.raises(WebSocketDenialResponse), client.websocket_connect("/v1/objects/stream",
                                                                             headers=bearer(t[who])):
            pass


def test_revoked_expired_and_malformed_tokens_are_refused(world, monkeypatch):
    _, store, client = world
    t = accounts(store)
    tid = t["alice"].split("_")[1]
    assert client.get("/v1/info", headers=bearer(t["alice"])).status_code == 200
    tokens.revoke(store, tid)
    r = client.get("/v1/info", headers=bearer(t["alice"]))
    assert r.status_code == 401 and "revoked" in r.json()["detail"]
    row, secret = tokens.create(store, "bob", "read", expires_in=3600)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 7200)
    r = client.get("/v1/info", headers=bearer(secret))
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    monkeypatch.setattr(time, "time", real)
    good = t["bob"]
    for bad in (good[:-1] + ("A" if good[-1] != "A" else "B"), good + "x", "cap_zzzzzzzzzzzz_" + "a" * 43,
                "cap_" + "0" * 12 + "_" + "a" * 43, "x" * 5000, "Basic abc"):
        r = client.get("/v1/info", headers=bearer(bad))
        assert r.status_code == 401 and r.json()["detail"] == "missing or wrong bearer token"
    assert client.get("/v1/info", headers={"Authorization": good}).status_code == 401     # no scheme


def test_password_sign_in_carries_the_user_and_failures_are_bounded(world):
    app, store, client = world
    accounts(store)
    r = client.post("/api/session", json={"user": "alice", "password": PASSWORD})
    assert r.status_code == 200 and r.json()["user"] == "alice" and r.json()["role"] == "owner"
    csrf = r.json()["csrf"]
    assert [c["name"] for c in client.get("/api/capsules").json()] == [SECRET]
    r = client.post(f"/api/capsules/{OTHER}/derive", json={"child": "y"}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 403 and r.json()["error"] == "forbidden"
    client.cookies.clear()
    clock = app.state.sign_in_attempts.clock
    for _ in range(5):
        r = client.post("/api/session", json={"user": "alice", "password": "wrong password"})
        assert r.status_code == 401 and "set-cookie" not in r.headers
    r = client.post("/api/session", json={"user": "alice", "password": PASSWORD})     # right, but too soon
    assert r.status_code == 429 and r.json()["error"] == "too_many_attempts"
    assert 1 <= int(r.headers["retry-after"]) <= 60 and r.json()["retry_after"] == int(r.headers["retry-after"])
    assert client.post("/api/session", json={"token": TOKEN}).status_code == 429       # same address
    clock.now += 61
    assert client.post("/api/session", json={"user": "alice", "password": PASSWORD}).status_code == 200
    assert client.post("/api/session", json={"user": "alice"}).status_code == 400         # no password


def test_attempts_are_counted_per_address_and_per_user():
    clock = Clock()
    a = Attempts(limit=2, window=60, clock=clock)
    for _ in range(2):
        a.check("address:1", "user:alice")
        a.failed("address:1", "user:alice")
    with pytest.raises(TooManyAttempts):
        a.check("address:2", "user:alice")          # another address, same user
    with pytest.raises(TooManyAttempts):
        a.check("address:1", "user:bob")            # same address, another user
    a.check("address:2", "user:bob")
    clock.now += 60.5
    a.check("address:1", "user:alice")


def test_every_change_is_audited_allowed_or_refused_and_looks_are_not(world):
    _, store, client = world
    t = accounts(store)
    tid = t["alice"].split("_")[1]
    assert client.get("/api/capsules", headers=bearer(t["alice"])).status_code == 200
    assert client.get(f"/v1/capsules/{SECRET}/versions/latest", headers=bearer(t["alice"])).status_code == 200
    assert lines(store) == []                                               # looks leave no line
    client.post(f"/api/capsules/{SECRET}/derive", json={"child": "kid"}, headers=bearer(t["alice"]))
    client.post(f"/api/capsules/{OTHER}/rm", json={}, headers=bearer(t["alice"]))
    client.post(f"/api/capsules/{OTHER}/rm", json={}, headers=bearer("wrong-token-0123456789"))
    client.post("/api/session", json={"user": "alice", "password": "nope nope nope"})
    client.post(f"/api/capsules/{SECRET}/derive", json={"child": "bad name!"}, headers=bearer(t["alice"]))
    got = [(e["who"], e["action"], e["capsule"], e["result"]) for e in lines(store)]
    assert got == [
        (f"alice/{tid}", "POST /api/capsules/{name}/derive", SECRET, "ok"),
        (f"alice/{tid}", "POST /api/capsules/{name}/rm", OTHER, "forbidden"),
        ("unknown-token", "POST /api/capsules/{name}/rm", None, "auth_failed"),
        ("alice", "POST /api/session", None, "auth_failed"),
        (f"alice/{tid}", "POST /api/capsules/{name}/derive", SECRET, "invalid_name"),
    ]
    e = lines(store)[0]
    assert e["from"] == "testclient" and e["via"] == "agent" and abs(e["time"] - time.time()) < 60
    assert stat.S_IMODE(os.stat(store.home / audit.FILE).st_mode) == 0o600
    assert store.catalogue.capsule(OTHER) is not None                     # the refused rm did nothing


def test_bad_input_is_refused_clearly_and_changes_nothing(world):
    _, store, _ = world
    users.add(store, "alice", "owner", PASSWORD)
    before = (users.users(store), tokens.tokens(store), owners.owners(store))
    for call, exc, words in (
        (lambda: users.add(store, "Alice Smith", "owner"), InvalidName, "user name"),
        (lambda: users.add(store, "carol", "root"), InvalidName, "role"),
        (lambda: users.add(store, "carol", "owner", "short"), InvalidName, "8 to 1024"),
        (lambda: users.add(store, "alice", "owner"), AlreadyExists, "exists"),
        (lambda: tokens.create(store, "alice", "host"), InvalidName, "cannot hold scope 'host'"),
        (lambda: tokens.create(store, "alice", "read,everything"), InvalidName, "unknown scope"),
        (lambda: tokens.create(store, "alice", ""), InvalidName, "at least one scope"),
        (lambda: tokens.create(store, "nobody", "read"), NotFound, "no user"),
        (lambda: tokens.revoke(store, "../../etc"), InvalidName, "12 hex digits"),
        (lambda: owners.set_owner(store, SECRET, "nobody"), NotFound, "no user"),
        (lambda: owners.set_owner(store, "no-such", "alice"), NotFound, "no capsule"),
        (lambda: users.set_password(store, "alice", "x"), InvalidName, "8 to 1024"),
    ):
        with pytest.raises(exc, match=words):
            call()
    assert (users.users(store), tokens.tokens(store), owners.owners(store)) == before
    assert users.sign_in(store, "alice", PASSWORD) is not None              # the password did not change
    users.add(store, "root", "admin")
    with pytest.raises(Conflict, match="last admin"):
        users.remove(store, "root")
    assert users.admin_exists(store)


def test_passwords_and_tokens_are_never_stored_as_given(world):
    _, store, _ = world
    users.add(store, "alice", "owner", PASSWORD)
    _, secret = tokens.create(store, "alice", "read")
    dump = "\n".join(store.catalogue.db.iterdump())
    assert PASSWORD not in dump and secret not in dump and secret[17:] not in dump
    stored = store.catalogue.query("SELECT password FROM users WHERE name='alice'")[0]["password"]
    assert stored.startswith("scrypt$") and passwords.verify_password(PASSWORD, stored)
    assert not passwords.verify_password(PASSWORD + "!", stored)
    assert stored != passwords.hash_password(PASSWORD)                       # salted: never the same twice
    assert users.sign_in(store, "alice", "wrong password") is None
    assert users.sign_in(store, "nobody", PASSWORD) is None
    assert users.sign_in(store, "alice", PASSWORD).role == "owner"
    assert not passwords.verify_password(PASSWORD, "scrypt$40$8$1$AAAA$AAAA")  # absurd cost: refused, not run


def test_the_audit_log_reads_back_filtered(tmp_path):
    audit.record(tmp_path, who="alice/0123456789ab", action="POST /x", capsule="a", remote="::1", now=1000.0)
    audit.record(tmp_path, who="bob", action="POST /y", result="forbidden", now=5000.0)
    with open(tmp_path / audit.FILE, "a") as f:
        f.write("not json\n")
    assert [e.get("who") for e in audit.entries(tmp_path, since=2000.0)] == ["bob", None]
    assert [e.get("action") for e in audit.entries(tmp_path, user="alice")] == ["POST /x", None]  # damage shows
    assert audit.parse_since("1h", now=10_000.0) == 10_000.0 - 3600
    assert audit.parse_since("2026-01-31T00:00:00+00:00") == 1769817600.0
    with pytest.raises(InvalidName, match="--since"):
        audit.parse_since("yesterday")
    text = (tmp_path / audit.FILE).read_text()
    assert text.count("\n") == 3 and json.loads(text.splitlines()[0])["capsule"] == "a"


def test_a_host_caller_gets_an_expiring_read_grant_for_one_version_for_a_third_host(world):
    """What a fleet rollout's origin asks of a source host for the host that pulls from it: a grant to read one
    version, that expires; a request without what it allows, or malformed, is refused and mints nothing."""
    _, store, client = world
    t = accounts(store)
    r = client.post("/v1/grants/host", json={"allow": "read", "capsule": SECRET, "version": 1, "expires_in": 600},
                    headers=bearer(t["host"]))
    assert r.status_code == 200, r.text
    grant = r.json()
    assert (grant["allow"], grant["capsule"], grant["version"]) == ("read", SECRET, 1)
    g = tokens.get(store, grant["id"])
    assert g.user == tokens.HOST_USER and g.grant is not None and g.grant.describe() == f"read {SECRET}@1"
    assert (g.grant.issuer, g.grant.issuer_token) == ("ops", t["host"].split("_")[1])
    assert 590 < g.expires - time.time() <= 600
    h = bearer(grant["token"])
    assert client.get(f"/v1/capsules/{SECRET}/versions/1", headers=h).status_code == 200
    assert client.post("/v1/objects/missing", json={"layers": []}, headers=h).status_code == 403
    assert client.post(f"/v1/capsules/{SECRET}/start", headers=h).status_code == 403
    assert client.post("/v1/grants/host", json={"allow": "read", "capsule": SECRET},
                       headers=bearer(t["alice"])).status_code == 403
    before = len(tokens.tokens(store, tokens.HOST_USER))
    for bad, words in (({"expires_in": 600}, "what it allows"), ({"allow": "everything", "capsule": SECRET},
                       "what it allows"), ({"allow": "read"}, "what it allows"),
                       ({"allow": "read", "capsule": SECRET, "expires_in": 5}, "expires_in"),
                       ({"allow": "read", "capsule": SECRET, "expires_in": 10**7}, "expires_in"),
                       ({"allow": "read", "capsule": SECRET, "expires_in": "1h"}, "expires_in"),
                       ({"allow": "read", "capsule": SECRET, "version": "1"}, "version number"),
                       ({"allow": "push", "record": {"capsule": SECRET}}, "record"), ([1], "what it allows")):
        r = client.post("/v1/grants/host", json=bad, headers=bearer(t["host"]))
        assert r.status_code == 400 and words in r.json()["detail"], (bad, r.text)
    r = client.post("/v1/grants/host", json={"allow": "read", "capsule": "no-such"}, headers=bearer(t["host"]))
    assert r.status_code == 404 and "nothing to grant" in r.json()["detail"]
    assert len(tokens.tokens(store, tokens.HOST_USER)) == before
    assert [e["action"] for e in lines(store)].count("POST /v1/grants/host") >= 2
