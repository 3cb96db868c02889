"""The HTTP authorization matrix: every route of ``authz.RULES`` × every kind of caller, through a real agent app
(TestClient on ``create_app``), each answer classed as refused (401/403) or admitted (anything else: the route's
own work may then fail with 400/404/409 — the requests are shaped so that it does, harmlessly). The expected
table below is the policy, stated independently of the rules; a wrong rule fails it.

Callers: nobody (anonymous); ``owner`` (alice, who owns the capsule on the path, alices-desk); ``other`` (bob,
who owns another); ``operator``; ``admin``; ``grant`` (read alices-desk); ``grant-other`` (read bobs-desk);
``push`` (receive alices-desk@9); ``push-other`` (receive bobs-desk@9). The object on a path is alices-desk's
own layer; the record sent to ``POST /v1/versions`` is alices-desk@9's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from starlette.testclient import WebSocketDenialResponse

from capsule.agent import authz
from capsule.agent.migrations import MigrateIn, Migration
from capsule.hosts import Peer
from hashcache.hcp import decode_stream_reply, encode_stream_read
from tests.helpers.grantworld import A, B, World, bearer, make_world

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

USERS = {"owner", "other", "operator", "admin"}
GRANTS = {"grant", "grant-other", "push", "push-other"}
CALLERS = ["anonymous", *sorted(USERS), *sorted(GRANTS)]
# who is admitted, per kind of route (everyone else is refused)
KINDS = {
    "users": USERS,                                   # signed in, or a listing each sees their part of
    "info": USERS | GRANTS,                           # GET /v1/info: also every grant
    "version": {"owner", "operator", "admin", "grant"},      # a capsule's version record: its owner, its grant
    "staff": {"operator", "admin"},                   # host calls and staff actions: no owner, no grant
    "missing": {"operator", "admin", "push", "push-other"},  # what a pushing peer asks first
    "hcp-read": {"operator", "admin", "grant"},       # LOOKUP, READ-HASH, READ, each stream message: its own
    "receive": {"operator", "admin", "push"},         # recv of an object, the record: the push it was made for
    "grant-only": GRANTS,                             # DELETE /v1/grants/self
    "act": {"owner", "operator", "admin"},            # acting on one capsule: its owner, staff
    "look-own": {"owner", "operator", "admin"},       # a migration of the capsule
}
EXPECTED = {
    ("GET", "/v1/info"): "info",
    ("GET", "/v1/capsules"): "users",
    ("GET", "/v1/capsules/{name}/versions/{number}"): "version",
    ("POST", "/v1/objects/missing"): "missing",
    ("GET", "/v1/objects/{kind}/{oid}"): "hcp-read",
    ("GET", "/v1/objects/{kind}/{oid}/records"): "hcp-read",
    ("POST", "/v1/objects/{kind}/{oid}/read"): "hcp-read",
    ("WS", "/v1/objects/stream"): "hcp-read",
    ("POST", "/v1/recv/{kind}/{oid}/begin"): "receive",
    ("POST", "/v1/recv/{kind}/{oid}/blocks"): "receive",
    ("POST", "/v1/recv/{kind}/{oid}/lacking"): "receive",
    ("POST", "/v1/recv/{kind}/{oid}/commit"): "receive",
    ("POST", "/v1/versions"): "receive",
    ("POST", "/v1/fleet/pull"): "staff",
    ("POST", "/v1/fleet/restore"): "staff",
    ("POST", "/v1/grants/host"): "staff",
    ("DELETE", "/v1/grants/self"): "grant-only",
    ("GET", "/v1/fleet/activity"): "users",
    ("POST", "/v1/verify"): "staff",
    ("POST", "/v1/backups/{name}/prune"): "staff",
    ("POST", "/v1/capsules/{name}/start"): "act",
    ("POST", "/v1/run"): "staff",
    ("POST", "/v1/capsules/{name}/activate"): "act",
    ("POST", "/v1/capsules/{name}/stop"): "act",
    ("GET", "/v1/pods"): "staff",
    ("POST", "/v1/pods/restore"): "staff",
    **{("POST", path): "staff" for path in ("/v1/live/check", "/v1/live/prepare", "/v1/live/{mid}/finish",
                                            "/v1/live/{mid}/abort", "/v1/live/{mid}/recover")},
    ("GET", "/api/capsules/{name}/migrate/check"): "act",
    ("GET", "/api/capsules/{name}/clipboard"): "act",
    ("PUT", "/api/capsules/{name}/clipboard"): "act",
    ("PUT", "/api/capsules/{name}/screen-size"): "act",
    ("POST", "/v1/tunnel"): "staff",
    ("DELETE", "/v1/tunnel/{session}"): "staff",
    ("WS", "/v1/tunnel/{session}/{channel}"): "staff",
    ("GET", "/api/session"): "users",
    ("DELETE", "/api/session"): "users",
    ("GET", "/api/capsules"): "users",
    ("GET", "/api/hosts"): "users",
    ("GET", "/api/tree"): "staff",
    **{("POST", f"/api/capsules/{{name}}/{verb}"): "act"
       for verb in ("start", "suspend", "snapshot", "stop", "derive", "rm", "console-ticket", "migrate")},
    **{(m, "/api/{rest:path}"): "users" for m in ("GET", "POST", "PUT", "PATCH", "DELETE")},
    ("WS", "/api/console/{name}"): "act",
    ("WS", "/api/console/{name}/serial"): "act",
    ("POST", "/api/hosts/{host}/capsules/{name}/console-ticket"): "staff",
    ("WS", "/api/hosts/{host}/console/{name}"): "staff",
    ("WS", "/api/hosts/{host}/console/{name}/serial"): "staff",
    ("GET", "/api/hosts/{host}/capsules/{name}/clipboard"): "staff",
    ("PUT", "/api/hosts/{host}/capsules/{name}/clipboard"): "staff",
    ("PUT", "/api/hosts/{host}/capsules/{name}/screen-size"): "staff",
    # Bring here and a peer's hierarchy: asked of the peer with this host's own token, so staff only
    ("GET", "/api/hosts/{host}/tree"): "staff",
    ("GET", "/api/hosts/{host}/capsules/{name}/bring/check"): "staff",
    ("POST", "/api/hosts/{host}/capsules/{name}/bring"): "staff",
    ("GET", "/api/hosts/{host}/migrations/{mid}"): "staff",
    ("GET", "/api/hosts/{host}/migrations/{mid}/events"): "staff",
    ("POST", "/api/hosts/{host}/migrations/{mid}/cancel"): "staff",
    ("GET", "/api/migrations"): "users",
    ("GET", "/api/migrations/{mid}"): "look-own",
    ("GET", "/api/migrations/{mid}/events"): "look-own",
    ("POST", "/api/migrations/{mid}/cancel"): "look-own",
    ("GET", "/api/backups"): "users",
    ("POST", "/api/backups/verify"): "staff",
    ("POST", "/api/backups/{name}/run"): "act",
    ("POST", "/api/backups/{name}/restore"): "act",
}
# a body every route refuses after authorization (a version 0, an unknown policy, a negative timeout), and a
# query likewise (start / activate version 0, discard=maybe)
BAD = {"version": 0, "balloon_policy": "bogus", "timeout": -1}
QUERY = "?version=0&discard=maybe&timeout=-1"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    from capsule.backup import verifyjob

    mp = pytest.MonkeyPatch()
    mp.setenv("CAPSULE_HASHCACHE_SIZE", str(1 << 20))
    mp.setattr(verifyjob, "run_job", lambda _store: None)     # "a verify is running already" (409): no qemu-img
    w = make_world(tmp_path_factory.mktemp("matrix"))
    m = Migration(A, Peer("office", "http://office:7070", "x", 0.0, "t" * 20), MigrateIn(to="office"))
    m.publish(replace(m.last, seq=1, outcome="failed", where="source", message="ended"))   # its events end
    w.app.state.migrations._by_id[m.id] = m  # noqa: SLF001 - a migration of alices-desk, as if run here
    w.app.state.test_mid = m.id
    yield w
    w.store.close()
    mp.undo()


def _tokens(w: World) -> dict[str, str | None]:
    """Fresh grants for each route (``DELETE /v1/grants/self`` ends the one that calls it)."""
    return {"anonymous": None, "owner": w.t["alice"], "other": w.t["bob"], "operator": w.t["operator"],
            "admin": w.t["admin"], "grant": w.grant(allow="read", capsule=A),
            "grant-other": w.grant(allow="read", capsule=B), "push": w.grant(allow="push", record=w.record(A, 9)),
            "push-other": w.grant(allow="push", record=w.record(B, 9))}


def _path(w: World, template: str) -> str:
    return (template.replace("{rest:path}", "some/where").replace("{name}", A).replace("{host}", "office")
            .replace("{kind}", "layer").replace("{oid}", w.o["a_layer"]).replace("{number}", "1")
            .replace("{mid}", w.app.state.test_mid))


def _refused_ws(w: World, path: str, token: str | None) -> bool:
    headers = bearer(token) if token else {}
    try:
        with w.client.websocket_connect(path, headers=headers) as ws:
            if path == "/v1/objects/stream":     # one READ of alices-desk's layer: refused in its reply?
                ws.send_bytes(encode_stream_read("layer", w.o["a_layer"], [0], 1))
                _payload, err = decode_stream_reply(ws.receive_bytes())
                return err.get("status") in (401, 403)
            return False
    except WebSocketDenialResponse as exc:
        # a console's own ticket check (after the guard admitted the caller) is not a refusal of the caller
        return exc.status_code in (401, 403) and "console ticket" not in exc.text
    except Exception:  # noqa: BLE001 - the route closed an admitted connection
        return False


def _refused(w: World, method: str, template: str, token: str | None) -> bool:
    path = _path(w, template)
    if method == "WS":
        return _refused_ws(w, path, token)
    headers = bearer(token) if token else {}
    body = w.record(A, 9) if template == "/v1/versions" else BAD
    r = w.client.request(method, path + QUERY, json=body, headers=headers)
    if r.status_code in (401, 403):
        return True
    assert r.status_code != 500, (method, template, r.text)
    return False


def test_the_table_names_every_route_the_rules_do(world):
    public = {k for k, r in authz.RULES.items() if r.public}
    assert set(EXPECTED) | public == set(authz.RULES) == set(authz.routes_of(world.app))


@pytest.mark.parametrize("key", sorted(EXPECTED), ids=lambda k: f"{k[0]} {k[1]}")
def test_each_caller_is_refused_or_admitted_as_the_policy_says(world, key):
    method, template = key
    tokens = _tokens(world)
    got = {who for who in CALLERS if not _refused(world, method, template, tokens[who])}
    assert got == KINDS[EXPECTED[key]], f"{method} {template}: admitted {sorted(got)}"
