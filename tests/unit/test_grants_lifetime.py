"""How a grant ends, through a real agent app: it ends with the token or user that made it (and one
made with the old host token, with the first admin); it ends itself when its job is done, for good; an old
unbounded ``@host`` row is refused, in a ``tokens`` table upgraded in place; a demand run's grant is bounded
too, and its destination ends it once nothing reads from the source (a run stopped, or all of it local).
``capsule token ls`` shows what each grant allows and who made it."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from capsule import transfer
from capsule.accounts import grants, tokens, users
from capsule.agent.app import create_app
from capsule.cli.main import app as cli
from capsule.lifecycle import demand
from capsule.store import Store
from capsule.store.catalogue import InstanceRow
from capsule.store.objectio import object_manifest
from hashcache.transport.memory import in_process
from tests.helpers.grantworld import TOKEN, A, B, bearer, make_world
from tests.helpers.inprocess_agent import InProcessAgent

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSULE_HASHCACHE_SIZE", str(1 << 20))
    w = make_world(tmp_path)
    yield w
    w.store.close()


def _info(w, token: str) -> int:
    return w.client.get("/v1/info", headers=bearer(token)).status_code


def test_a_grant_ends_with_the_token_or_the_user_that_made_it(world):
    w = world
    by_host = w.grant(allow="read", capsule=A)
    _, admin2 = tokens.create(w.store, "root", "host")
    by_root = w.client.post("/v1/grants/host", json={"allow": "read", "capsule": B},
                            headers=bearer(admin2)).json()["token"]
    users.add(w.store, "ops2", "operator")
    _, ops2 = tokens.create(w.store, "ops2", "host")
    by_ops2 = w.client.post("/v1/grants/host", json={"allow": "read", "capsule": B},
                            headers=bearer(ops2)).json()["token"]
    assert {_info(w, g) for g in (by_host, by_root, by_ops2)} == {200}
    tokens.revoke(w.store, w.t["host"].split("_")[1])             # the token that made it
    r = w.client.get("/v1/info", headers=bearer(by_host))
    assert r.status_code == 401 and "ended with the user or token that made it (ops)" in r.json()["detail"]
    assert _info(w, by_root) == 200 and _info(w, by_ops2) == 200   # others' grants stand
    users.remove(w.store, "ops2")                                  # the user that made it
    assert _info(w, by_ops2) == 401 and _info(w, by_root) == 200
    assert tokens.get(w.store, by_ops2.split("_")[1]).state() == "revoked"
    users.add(w.store, "ops2", "operator")                         # a new user of that name revives nothing
    assert _info(w, by_ops2) == 401


def test_a_grant_made_with_the_old_host_token_ends_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSULE_HASHCACHE_SIZE", str(1 << 20))
    w = make_world(tmp_path)
    try:
        w.store.catalogue.query("DELETE FROM users WHERE role='admin'")   # as before the first admin
        r = w.client.post("/v1/grants/host", json={"allow": "read", "capsule": A}, headers=bearer(TOKEN))
        assert r.status_code == 200 and r.json()["issuer"] == tokens.LEGACY_ISSUER
        g = r.json()["token"]
        assert _info(w, g) == 200
        users.add(w.store, "root2", "admin")
        assert _info(w, g) == 401 and tokens.get(w.store, r.json()["id"]).state() == "revoked"
    finally:
        w.store.close()


def test_a_grant_ends_itself_and_that_is_final(world):
    w = world
    token = w.grant(allow="read", capsule=A)
    r = w.client.delete("/v1/grants/self", headers=bearer(token))
    assert r.status_code == 200 and r.json() == {"revoked": token.split("_")[1], "state": "revoked"}
    for method, path in (("GET", "/v1/info"), ("GET", f"/v1/objects/file/{w.o['a_mem']}"),
                         ("DELETE", "/v1/grants/self")):
        assert w.client.request(method, path, headers=bearer(token)).status_code == 401, path
    r = w.client.delete("/v1/grants/self", headers=bearer(w.t["admin"]))          # a user's token: refused
    assert r.status_code == 403 and "capsule token revoke" in r.json()["detail"]
    assert _info(w, w.t["admin"]) == 200
    assert [e["action"] for e in _audit(w) if e["result"] == "ok"].count("DELETE /v1/grants/self") == 1


def _audit(w) -> list[dict]:
    from capsule import audit
    return list(audit.entries(w.store.home))


def test_an_old_unbounded_host_grant_is_refused_in_a_table_upgraded_in_place(tmp_path):
    """A store made before grants named what they allow: its tokens table gains the new columns where it is,
    its users' tokens keep working, and its @host rows (no capability, no expiry) are refused."""
    home = tmp_path / "s"
    Store.open(home).close()
    db = sqlite3.connect(home / "catalogue.sqlite")
    db.execute("DROP TABLE users")           # the tables as 0.1.0 made them, in a catalogue without a version
    db.execute("DROP TABLE tokens")
    db.execute("PRAGMA user_version = 0")
    db.execute("CREATE TABLE users(name TEXT PRIMARY KEY, role TEXT NOT NULL, password TEXT, created REAL NOT NULL)")
    db.execute("CREATE TABLE tokens(id TEXT PRIMARY KEY, user TEXT NOT NULL, scopes TEXT NOT NULL, hash TEXT "
               "NOT NULL, created REAL NOT NULL, expires REAL, revoked REAL)")
    db.execute("INSERT INTO users VALUES('root','admin',NULL,1.0)")
    secret = "s" * 43
    digest = tokens._digest(secret)  # noqa: SLF001 - a row as an older version wrote it
    db.execute("INSERT INTO tokens VALUES('0123456789ab','@host','host',?,1.0,NULL,NULL)", (digest,))
    db.execute("INSERT INTO tokens VALUES('ba9876543210','root','read,admin',?,1.0,NULL,NULL)", (digest,))
    db.commit()
    db.close()
    client = TestClient(create_app(home, TOKEN))
    r = client.get("/v1/info", headers=bearer(f"cap_0123456789ab_{secret}"))
    assert r.status_code == 401 and "old host grant" in r.json()["detail"]
    assert client.get("/v1/objects/layer/" + "ab" * 32, headers=bearer(f"cap_0123456789ab_{secret}")
                      ).status_code == 401
    assert client.get("/v1/info", headers=bearer(f"cap_ba9876543210_{secret}")).status_code == 200
    store = Store.open(home)
    try:
        columns = {r[1] for r in store.catalogue.query("PRAGMA table_info(tokens)")}
        assert {"allow", "capsule", "version", "issuer", "issuer_token", "detail"} <= columns
        assert tokens.get(store, "0123456789ab").state() == "expired"
    finally:
        store.close()


def test_a_demand_runs_grant_reads_one_capsule_and_expires(world, monkeypatch):
    """What a demand run's destination pages the disks in with (it used to be a host grant with no expiry)."""
    w = world
    token = grants.for_demand_run(w.store, TOKEN, A, "unix:me")
    assert token != TOKEN                                                      # an admin exists
    g = tokens.get(w.store, token.split("_")[1])
    assert g.grant is not None and g.grant.describe() == f"read {A}" and g.grant.issuer == "unix:me"
    assert abs(g.expires - time.time() - grants.DEMAND_RUN_SECONDS) < 60 and grants.DEMAND_RUN_SECONDS <= 7 * 86400
    assert w.client.get(f"/v1/objects/file/{w.o['a_mem']}", headers=bearer(token)).status_code == 200
    assert w.client.get(f"/v1/objects/file/{w.o['b_mem']}", headers=bearer(token)).status_code == 403
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + grants.DEMAND_RUN_SECONDS + 1)
    r = w.client.get("/v1/info", headers=bearer(token))
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    monkeypatch.setattr(time, "time", real)
    other = grants.for_demand_run(w.store, TOKEN, A, "unix:me")
    assert _info(w, other) == 200
    grants.discard(w.store, other)                                  # the migration failed: it ends at once
    assert _info(w, other) == 401


def test_token_ls_shows_what_a_grant_allows_and_who_made_it(world, monkeypatch):
    from capsule.cli import common

    monkeypatch.setattr(common.console, "width", 200)           # the whole table on one line per token
    w = world
    token = w.grant(allow="read", capsule=A, version=1)
    gid, tid = token.split("_")[1], w.t["host"].split("_")[1]
    r = CliRunner().invoke(cli, ["--home", str(w.store.home), "token", "ls", "--user", "@host"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if gid in x)
    assert f"read {A}@1" in line and f"ops/{tid}" in line and "active" in line
    r = CliRunner().invoke(cli, ["--home", str(w.store.home), "--json", "token", "ls"])
    row = next(x for x in json.loads(r.output) if x["id"] == gid)
    assert (row["allow"], row["capsule"], row["version"], row["issuer"], row["issuer_token"], row["state"]) == (
        "read", A, 1, "ops", tid, "active")
    assert next(x for x in json.loads(r.output) if x["user"] == "alice")["allow"] is None


def test_the_destination_ends_its_grant_once_nothing_reads_from_the_source(world, tmp_path):
    """A demand run's destination: its remote layer read with a grant of the source; the grant ends when no
    running instance reads from the source any more — not while one does, nor for a newer run's token, nor
    for a token that is no grant (kept) — and when every layer it sent is local (localize)."""
    w = world
    source = InProcessAgent(w.store.home, TOKEN)
    dest = Store.open(tmp_path / "dest")
    try:
        token = w.grant(allow="read", capsule=A, version=1)
        manifest = object_manifest(w.store, "layer", w.o["a_layer"])
        demand.add_remote_layer(dest, manifest, source.url, token)
        lid, path = manifest.digest, demand.token_path(dest, source.url)
        with dest.catalogue.transaction():
            dest.catalogue.add_instance(InstanceRow(A, 1, "capsule-x", [], [[lid]], "tcg", str(tmp_path),
                                                    started=time.time()))
        assert demand.release_sources(dest, demand.sources_of(dest, [lid])) == []    # it still runs
        dest.catalogue.delete_instance(A)
        assert demand.release_sources(dest, {source.url: None}, since=path.stat().st_mtime - 10) == []  # newer
        assert demand.release_sources(dest, {source.url: None}) == [source.url]
        assert not path.exists() and _info(w, token) == 401
        assert tokens.get(w.store, token.split("_")[1]).state() == "revoked"
        demand.token_file_for(dest, source.url, w.t["host"])          # a user's token: not a grant, kept
        assert demand.release_sources(dest, {source.url: None}) == [] and path.exists()
        # localize: the layer is here now (pulled); the source's grant ends with its last remote layer
        token = w.grant(allow="read", capsule=A, version=1)
        demand.token_file_for(dest, source.url, token)
        transfer.pull(dest, "http://testserver", f"{A}@1", token, transport=in_process(w.app, token))
        assert demand.localize(dest) == [] and not demand.remote_info_path(dest, lid).exists()
        assert _info(w, token) == 401 and not path.exists()
    finally:
        dest.close()
        source.stop()
