"""Who may call which route: every route of the agent has its rule (a route without one stops the agent from
being made), and, table-driven, each kind of caller is allowed or refused on every route — admin, operator,
the owner of the capsule, an owner of other capsules, a host-only token, a read-only token, the old host token."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI

from capsule.accounts.model import ROLE_SCOPES, Principal, legacy_principal
from capsule.agent import authz
from capsule.agent.app import create_app
from capsule.errors import Forbidden, Internal
from capsule.store import Store
from tests.unit.test_accounts_agent import SECRET, make_home

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

CALLERS = {
    "admin": Principal("root", "admin", ROLE_SCOPES["admin"], "a" * 12),
    "operator": Principal("ops", "operator", ROLE_SCOPES["operator"], "b" * 12),
    "owner": Principal("alice", "owner", ROLE_SCOPES["owner"], "c" * 12),     # owns SECRET
    "other": Principal("bob", "owner", ROLE_SCOPES["owner"], "d" * 12),       # owns nothing
    "host": Principal("ops", "operator", frozenset({"host"}), "e" * 12),
    "read": Principal("ops", "operator", frozenset({"read"}), "f" * 12),
    "legacy": legacy_principal(),
}
EVERYONE = set(CALLERS)
# what each kind of call allows (the policy, stated here independently of authz.RULES)
KINDS = {
    "signed-in": EVERYONE,
    "look": EVERYONE - {"host"},
    "look-or-host": EVERYONE,
    "look-capsule-or-host": EVERYONE - {"other"},
    "look-staff": {"admin", "operator", "read", "legacy"},
    "host": {"admin", "operator", "host", "legacy"},
    "act": {"admin", "operator", "owner", "legacy"},
    "act-staff": {"admin", "operator", "legacy"},
    "look-migration": {"admin", "operator", "owner", "read", "legacy"},
    "look-staff-or-host": {"admin", "operator", "read", "host", "legacy"},
    "grant-only": set(),            # only a grant (none of these callers) ends itself
}
EXPECTED = {
    ("GET", "/v1/info"): "look-or-host",
    ("GET", "/v1/capsules"): "look-or-host",
    ("GET", "/v1/capsules/{name}/versions/{number}"): "look-capsule-or-host",
    ("POST", "/v1/objects/missing"): "host",
    ("GET", "/v1/objects/{kind}/{oid}"): "host",
    ("GET", "/v1/objects/{kind}/{oid}/records"): "host",
    ("POST", "/v1/objects/{kind}/{oid}/read"): "host",
    ("WS", "/v1/objects/stream"): "host",
    ("POST", "/v1/recv/{kind}/{oid}/begin"): "host",
    ("POST", "/v1/recv/{kind}/{oid}/blocks"): "host",
    ("POST", "/v1/recv/{kind}/{oid}/lacking"): "host",
    ("POST", "/v1/recv/{kind}/{oid}/commit"): "host",
    ("POST", "/v1/versions"): "host",
    ("POST", "/v1/fleet/pull"): "host",
    ("POST", "/v1/fleet/restore"): "host",
    ("POST", "/v1/grants/host"): "host",
    ("DELETE", "/v1/grants/self"): "grant-only",
    ("GET", "/v1/fleet/activity"): "look-or-host",
    ("POST", "/v1/verify"): "host",
    ("POST", "/v1/backups/{name}/prune"): "host",
    ("POST", "/v1/capsules/{name}/start"): "act",
    ("POST", "/v1/run"): "act-staff",
    ("POST", "/v1/capsules/{name}/activate"): "act",
    ("POST", "/v1/capsules/{name}/stop"): "act",
    ("GET", "/v1/pods"): "look-staff-or-host",
    ("POST", "/v1/pods/restore"): "host",
    **{("POST", path): "host" for path in ("/v1/live/check", "/v1/live/prepare", "/v1/live/{mid}/finish",
                                           "/v1/live/{mid}/abort", "/v1/live/{mid}/recover")},
    ("GET", "/api/capsules/{name}/migrate/check"): "act",
    **{(m, "/api/capsules/{name}/clipboard"): "act" for m in ("GET", "PUT")},
    ("PUT", "/api/capsules/{name}/screen-size"): "act",
    ("POST", "/v1/tunnel"): "host",
    ("DELETE", "/v1/tunnel/{session}"): "host",
    ("WS", "/v1/tunnel/{session}/{channel}"): "host",
    ("GET", "/api/session"): "signed-in",
    ("DELETE", "/api/session"): "signed-in",
    ("GET", "/api/capsules"): "look-or-host",
    ("GET", "/api/hosts"): "look",
    ("GET", "/api/tree"): "look-staff",
    ("GET", "/api/hosts/{host}/tree"): "look-staff",
    **{("POST", f"/api/capsules/{{name}}/{verb}"): "act"
       for verb in ("start", "suspend", "snapshot", "stop", "derive", "rm", "console-ticket", "migrate")},
    **{(m, "/api/{rest:path}"): "signed-in" for m in ("GET", "POST", "PUT", "PATCH", "DELETE")},
    ("WS", "/api/console/{name}"): "act",
    ("WS", "/api/console/{name}/serial"): "act",
    ("POST", "/api/hosts/{host}/capsules/{name}/console-ticket"): "act-staff",
    ("WS", "/api/hosts/{host}/console/{name}"): "act-staff",
    ("WS", "/api/hosts/{host}/console/{name}/serial"): "act-staff",
    ("GET", "/api/hosts/{host}/capsules/{name}/clipboard"): "act-staff",
    ("PUT", "/api/hosts/{host}/capsules/{name}/clipboard"): "act-staff",
    ("PUT", "/api/hosts/{host}/capsules/{name}/screen-size"): "act-staff",
    ("GET", "/api/hosts/{host}/capsules/{name}/bring/check"): "act-staff",
    ("POST", "/api/hosts/{host}/capsules/{name}/bring"): "act-staff",
    ("GET", "/api/hosts/{host}/migrations/{mid}"): "look-staff",
    ("GET", "/api/hosts/{host}/migrations/{mid}/events"): "look-staff",
    ("POST", "/api/hosts/{host}/migrations/{mid}/cancel"): "act-staff",
    ("GET", "/api/migrations"): "look",
    ("GET", "/api/migrations/{mid}"): "look-migration",
    ("GET", "/api/migrations/{mid}/events"): "look-migration",
    ("POST", "/api/migrations/{mid}/cancel"): "act",
    ("GET", "/api/backups"): "look",
    ("POST", "/api/backups/verify"): "act-staff",
    ("POST", "/api/backups/{name}/run"): "act",
    ("POST", "/api/backups/{name}/restore"): "act",
}
PUBLIC = {("POST", "/api/session"), ("GET", "/"), ("GET", "/openapi.json"), ("MOUNT", "/web"),
          ("MOUNT", "/web/vendor/novnc"), ("MOUNT", "/web/vendor/xterm")}


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> Iterator[FastAPI]:
    from capsule.accounts import owners, users

    home = make_home(tmp_path_factory.mktemp("authz"))
    app = create_app(home, "the-host-token-0123456789abcdef")
    store = Store.open(home)
    for name, role in (("root", "admin"), ("ops", "operator"), ("alice", "owner"), ("bob", "owner")):
        users.add(store, name, role)
    owners.set_owner(store, SECRET, "alice")
    app.state.test_store = store
    yield app
    store.close()


def test_every_route_has_a_rule_and_the_table_names_every_route(app):
    served = authz.routes_of(app)
    assert len(served) >= 50
    assert set(served) == set(authz.RULES), "a route without a rule, or a rule without a route"
    assert set(EXPECTED) | PUBLIC == set(served), "this test's table must name every route too"
    assert {k for k, r in authz.RULES.items() if r.public} == PUBLIC


def test_an_app_with_a_route_no_rule_names_is_refused(app):
    @app.post("/v1/new-thing")
    def new_thing() -> None:  # pragma: no cover - never served
        return None

    try:
        with pytest.raises(Internal, match="no authorization rule for POST /v1/new-thing"):
            authz.check_rules(app)
    finally:
        app.router.routes.pop()
    authz.check_rules(app)


def _probe(template: str) -> str:
    return (template.replace("{rest:path}", "some/where").replace("{name}", SECRET).replace("{host}", "office")
            .replace("{kind}", "layer").replace("{oid}", "ab" * 32).replace("{number}", "1")
            .replace("{mid}", "m1"))


@pytest.mark.parametrize("key", sorted(EXPECTED), ids=lambda k: f"{k[0]} {k[1]}")
def test_each_caller_allowed_or_refused_per_route(app, key):
    store: Store = app.state.test_store
    method, template = key
    found, params = authz.match(method, _probe(template))
    assert found == key
    rule = authz.RULES[found]
    allowed = KINDS[EXPECTED[key]]
    for who, principal in CALLERS.items():
        capsule = SECRET if rule.capsule else None      # a migration's capsule is SECRET here too
        if who in allowed:
            authz.check(store, principal, rule, capsule)
        else:
            with pytest.raises(Forbidden) as info:
                authz.check(store, principal, rule, capsule)
            assert info.value.http_status == 403 and str(info.value)
