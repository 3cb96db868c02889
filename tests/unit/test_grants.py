"""Grants are capabilities for one job, not a role, on a real agent app through HTTP: a grant never mints grants
or prunes (the two reproductions of the security review), a read grant reaches only the objects of its capsule
or version — over HTTP and in every message of the block stream, which stays usable after a refusal — and the
pulls made with one keep working; a push grant receives its one version and nothing else; no grant touches
pods, starts, stops, runs or calls the dashboard's API."""

from __future__ import annotations

import pytest

from capsule import transfer
from capsule.accounts import tokens
from capsule.agent import authz
from capsule.errors import Forbidden
from capsule.store import Store
from capsule.transfer.records import record_version, version_record
from hashcache.hcp import decode_stream_reply, encode_indices, encode_stream_read
from hashcache.transport.memory import in_process
from tests.helpers.grantworld import A, B, bearer, make_world
from tests.helpers.received import receive_file, receive_layer, record_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSULE_HASHCACHE_SIZE", str(1 << 20))
    w = make_world(tmp_path)
    yield w
    w.store.close()


def _versions(w, name: str) -> list[int]:
    return [v.number for v in w.store.catalogue.versions(name)]


def test_a_grant_mints_no_grant_and_prunes_nothing(world):
    """The review's reproductions: a grant asking for a day-long grant with itself, and pruning the backups of a
    capsule it has nothing to do with, were both answered 200."""
    w = world
    g = bearer(w.grant(allow="read", capsule=B, version=1))
    before = len(w.store.catalogue.query("SELECT id FROM tokens"))
    r = w.client.post("/v1/grants/host", json={"allow": "read", "capsule": B, "expires_in": 86400}, headers=g)
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    assert "cannot make this call" in r.json()["detail"]
    assert len(w.store.catalogue.query("SELECT id FROM tokens")) == before          # nothing minted
    files = sorted(p.name for p in (w.store.home / "layers").iterdir())
    r = w.client.post(f"/v1/backups/{A}/prune", json={"policy": {"last": 1}}, headers=g)
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    assert _versions(w, A) == [1, 2, 3] and sorted(p.name for p in (w.store.home / "layers").iterdir()) == files
    mine = bearer(w.grant(allow="read", capsule=A))                    # not even on its own capsule
    assert w.client.post(f"/v1/backups/{A}/prune", json={"policy": {"last": 1}}, headers=mine).status_code == 403
    assert _versions(w, A) == [1, 2, 3]


def test_a_read_grant_reaches_only_its_versions_objects(world):
    w, o = world, world.o
    g = bearer(w.grant(allow="read", capsule=A, version=1))
    for kind, oid in (("layer", o["a_layer"]), ("layer", o["root"]), ("file", o["a_mem"]), ("file", o["kernel"])):
        assert w.client.get(f"/v1/objects/{kind}/{oid}", headers=g).status_code == 200, (kind, oid)
        assert w.client.get(f"/v1/objects/{kind}/{oid}/records", headers=g).status_code == 200
    r = w.client.post(f"/v1/objects/file/{o['a_mem']}/read", content=encode_indices([0, 1]), headers=g)
    assert r.status_code == 200 and r.headers["x-capsule-blocks"] == "2"
    for kind, oid in (("layer", o["b_layer"]), ("file", o["b_mem"]), ("layer", "ab" * 32)):
        for method, path in (("GET", ""), ("GET", "/records"), ("POST", "/read")):
            r = w.client.request(method, f"/v1/objects/{kind}/{oid}{path}", content=encode_indices([0]), headers=g)
            assert r.status_code == 403 and f"not an object of {A}@1" in r.json()["detail"], (oid, path, r.text)
    assert w.client.get(f"/v1/capsules/{A}/versions/1", headers=g).status_code == 200
    for ref in (f"{A}/versions/2", f"{A}/versions/latest", f"{B}/versions/1"):     # latest is A@3
        assert w.client.get(f"/v1/capsules/{ref}", headers=g).status_code == 403, ref
    assert w.client.get("/v1/info", headers=g).status_code == 200
    assert w.client.get("/v1/capsules", headers=g).status_code == 403                # no listing of the host


def test_a_capsule_read_grant_reads_every_version_also_one_made_after_it(world):
    w, o = world, world.o
    g = bearer(w.grant(allow="read", capsule=A))
    assert w.client.get(f"/v1/capsules/{A}/versions/latest", headers=g).json()["number"] == 3
    assert w.client.get(f"/v1/objects/file/{o['b_mem']}", headers=g).status_code == 403
    later = receive_layer(w.store, w.work, 9, o["a_layer"])              # a version made after the grant
    assert w.client.get(f"/v1/objects/layer/{later}", headers=g).status_code == 403
    record_version(w.store, record_of(A, 4, [o["root"], o["a_layer"], later], o["kernel"], o["initrd"]))
    assert w.client.get(f"/v1/objects/layer/{later}", headers=g).status_code == 200


def _read_msg(kind: str, oid: str) -> bytes:
    return encode_stream_read(kind, oid, [0], 1)


def test_the_block_stream_checks_every_message_and_stays_usable(world, monkeypatch):
    w, o = world, world.o
    token = w.grant(allow="read", capsule=A, version=1)
    with w.client.websocket_connect("/v1/objects/stream", headers=bearer(token)) as ws:
        for kind, oid, ok in (("file", o["a_mem"], True), ("file", o["b_mem"], False), ("layer", o["a_layer"], True),
                              ("layer", o["b_layer"], False), ("file", o["a_mem"], True)):
            ws.send_bytes(_read_msg(kind, oid))
            payload, err = decode_stream_reply(ws.receive_bytes())
            if ok:
                assert payload is not None, (kind, oid, err)
            else:
                assert payload is None and err["status"] == 403 and "not an object of" in err["detail"]
        monkeypatch.setattr(authz.StreamGate, "RECHECK", 0.0)
        tokens.revoke(w.store, token.split("_")[1])              # a revoked grant stops the stream too
        ws.send_bytes(_read_msg("file", o["a_mem"]))
        payload, err = decode_stream_reply(ws.receive_bytes())
        assert payload is None and err["status"] == 401 and "revoked" in err["detail"]


def test_pulls_with_a_read_grant_work_and_stop_at_its_version(world, tmp_path):
    w = world
    token = w.grant(allow="read", capsule=A, version=1)
    dest = Store.open(tmp_path / "dest")
    try:
        got = transfer.pull(dest, "http://testserver", f"{A}@1", token, transport=in_process(w.app, token))
        assert got.recorded and dest.catalogue.version(A, 1).chains == w.store.catalogue.version(A, 1).chains
        for ref in (f"{A}@2", f"{B}@1"):
            with pytest.raises(Forbidden, match="is not what this grant"):
                transfer.pull(dest, "http://testserver", ref, token, transport=in_process(w.app, token))
        assert dest.catalogue.capsule(B) is None
    finally:
        dest.close()


def test_a_push_grant_receives_its_version_and_nothing_else(world, tmp_path):
    w, o = world, world.o
    src = Store.open(tmp_path / "src")
    try:
        layer = receive_layer(src, tmp_path / "work", 20)
        files = [receive_file(src, tmp_path / "work", 21 + i, role) for i, role in enumerate(("kernel", "initrd"))]
        record_version(src, record_of("pushed", 1, [layer], *files))
        record_version(src, record_of("pushed", 2, [layer], *files))
        record = version_record(src, src.catalogue.version("pushed", 1))
        token = w.grant(allow="push", record=record)
        g = bearer(token)
        stray = receive_file(src, tmp_path / "work", 30, "memory")      # e.g. a pod image: not in the record
        with pytest.raises(Forbidden, match="not an object of pushed@1"):
            transfer.push_files(src, [(stray, "memory")], "http://testserver", token,
                                transport=in_process(w.app, token))
        with pytest.raises(Forbidden, match="only the version it was made for"):    # same objects, other version
            transfer.push(src, "pushed@2", "http://testserver", token, transport=in_process(w.app, token))
        assert w.store.catalogue.capsule("pushed") is None
        report = transfer.push(src, "pushed@1", "http://testserver", token, transport=in_process(w.app, token))
        assert report.recorded and w.store.catalogue.version("pushed", 1) is not None
        for other in (w.record(A, 9), w.record(B, 9), record | {"note": "mine now"}):
            r = w.client.post("/v1/versions", json=other, headers=g)
            assert r.status_code == 403 and "only the version it was made for" in r.json()["detail"], r.text
        for kind, oid in (("layer", o["a_layer"]), ("file", o["a_mem"])):         # it reads nothing
            assert w.client.get(f"/v1/objects/{kind}/{oid}", headers=g).status_code == 403
        assert _versions(w, A) == [1, 2, 3] and w.store.catalogue.version(A, 9) is None
    finally:
        src.close()


def test_no_grant_touches_pods_starts_stops_runs_or_the_dashboard(world):
    w = world
    calls = [("GET", f"/v1/pods?capsule={A}", None), ("POST", "/v1/pods/restore", {"image": "ab" * 32, "into": A}),
             ("POST", f"/v1/capsules/{A}/start", None), ("POST", f"/v1/capsules/{A}/stop", None),
             ("POST", f"/v1/capsules/{A}/activate?version=1", None), ("POST", "/v1/run", {}),
             ("POST", "/v1/fleet/pull", {}), ("POST", "/v1/verify", {"versions": [f"{A}@1"]}),
             ("GET", "/v1/fleet/activity", None), ("GET", "/api/capsules", None), ("GET", "/api/session", None),
             ("POST", f"/api/capsules/{A}/rm", {}), ("POST", f"/api/capsules/{A}/migrate", {"to": "x"}),
             ("GET", "/api/anything", None)]
    for token in (w.grant(allow="read", capsule=A), w.grant(allow="push", record=w.record(A, 9))):
        for method, path, body in calls:
            r = w.client.request(method, path, json=body, headers=bearer(token))
            assert r.status_code == 403 and "cannot make this call" in r.json()["detail"], (method, path, r.text)
    assert w.store.catalogue.instance(A) is None and _versions(w, A) == [1, 2, 3]
