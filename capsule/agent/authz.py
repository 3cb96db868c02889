"""Who may call what: the ONE table of the agent's routes and what each needs, and the one function that decides
(:func:`check`). The guard (:mod:`capsule.agent.guard`, ASGI middleware) applies it to every request (HTTP and
WebSocket) before any route runs, and writes the audit line of every change.

A rule says which token scopes a call accepts (any one of them), which roles may make it, and, for a call on one
capsule, where its name is: an ``owner`` acts only on capsules it owns; operators and admins on all. The guard:

1. finds the request's rule (:func:`match`, with Starlette's path compiler); ``create_app`` refuses to make an
   agent with a route no rule names (:func:`check_rules`), and a unit test walks the app's routes too;
2. authenticates: ``Authorization: Bearer`` (a user's token, or the old host token while no admin user exists),
   else the dashboard's session cookie (+ CSRF token and same-origin check on a change);
3. authorizes: scope, role, ownership → :class:`Forbidden` (403) naming what was missing;
4. for a call that changes something (every non-GET route but the few that only read), appends one line to the
   audit log (``capsule.audit``): who, what, which capsule, from where, and the result.

A grant (:mod:`capsule.accounts.grants`) is no role: a rule serves it only if it names the grant's capability
(``grants``), and then only on the rule's ``target`` — the object in the path (``object``), the capsule's
version in the path (``version``), each message of the block stream (``message``: :class:`StreamGate`), or the
version record in the body (``body``: the route calls :func:`check_record`). Every other route refuses grants.

Refusals are the agent's usual JSON errors; a dashboard call without a valid session gets the one bare 401."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI
from starlette.requests import HTTPConnection, Request
from starlette.routing import Mount, compile_path
from starlette.websockets import WebSocket

from capsule.accounts import grants, owners, tokens
from capsule.accounts.model import PUSH, READ, Grant, Principal
from capsule.agent.sessions import Caller
from capsule.errors import AuthFailed, Forbidden, Internal
from capsule.store import Store

ALL_ROLES = frozenset({"owner", "operator", "admin"})
STAFF = frozenset({"operator", "admin"})
ADMIN = frozenset({"admin"})


@dataclass(frozen=True)
class Rule:
    scopes: frozenset[str] = frozenset()     # any one of these (empty: any signed-in caller)
    roles: frozenset[str] = ALL_ROLES
    capsule: str | None = None               # "name": the path parameter; "migration": the migration's capsule
    public: bool = False                     # no authentication (sign-in, the page, its files)
    changes: bool = True                     # audited when the method is not GET (False: a POST that only reads)
    grants: frozenset[str] = frozenset()     # the grant capabilities it serves (none: grants are refused)
    target: str | None = None                # what a grant must reach: object, version, message, body (see above)


PUBLIC = Rule(public=True, changes=False)
ANY = Rule()                                               # signed in, whatever the scopes
LOOK = Rule(frozenset({"read", "capsules", "admin"}))      # listings: owners see only theirs
LOOK_OR_HOST = Rule(frozenset({"read", "capsules", "admin", "host"}))   # also what a peer asks before a push
LOOK_STAFF = Rule(frozenset({"read", "capsules", "admin"}), STAFF)
HOST = Rule(frozenset({"host"}), STAFF)                    # host-to-host calls
HOST_READS = Rule(frozenset({"host"}), STAFF, changes=False)
ACT = Rule(frozenset({"capsules"}), capsule="name")        # one capsule: owners only on theirs
ACT_STAFF = Rule(frozenset({"capsules"}), STAFF)
MIGRATION_LOOK = Rule(frozenset({"read", "capsules", "admin"}), capsule="migration")
MIGRATION_ACT = Rule(frozenset({"capsules"}), capsule="migration")
READING, PUSHING, EITHER = frozenset({READ}), frozenset({PUSH}), frozenset({READ, PUSH})
# HCP reads: host calls, and a read grant on an object of its capsule or version
HCP_READ = Rule(frozenset({"host"}), STAFF, grants=READING, target="object")
HCP_READ_POST = Rule(frozenset({"host"}), STAFF, changes=False, grants=READING, target="object")
RECEIVE = Rule(frozenset({"host"}), STAFF, grants=PUSHING, target="object")    # a push grant: its objects
RECEIVE_ASK = Rule(frozenset({"host"}), STAFF, changes=False, grants=PUSHING, target="object")   # reads only
GRANT_ONLY = Rule(roles=frozenset(), grants=EITHER)          # only a grant calls it (on itself)

RULES: dict[tuple[str, str], Rule] = {
    # -- HCP and host-to-host (capsule/agent/app.py) --
    ("GET", "/v1/info"): Rule(LOOK_OR_HOST.scopes, grants=EITHER),
    ("GET", "/v1/capsules"): LOOK_OR_HOST,
    ("GET", "/v1/capsules/{name}/versions/{number}"): Rule(LOOK_OR_HOST.scopes, capsule="name", grants=READING,
                                                           target="version"),
    ("POST", "/v1/objects/missing"): Rule(frozenset({"host"}), STAFF, changes=False, grants=PUSHING),
    ("GET", "/v1/objects/{kind}/{oid}"): HCP_READ,
    ("GET", "/v1/objects/{kind}/{oid}/records"): HCP_READ,
    ("POST", "/v1/objects/{kind}/{oid}/read"): HCP_READ_POST,
    ("WS", "/v1/objects/stream"): Rule(frozenset({"host"}), STAFF, grants=READING, target="message"),
    ("POST", "/v1/recv/{kind}/{oid}/begin"): RECEIVE,
    ("POST", "/v1/recv/{kind}/{oid}/blocks"): RECEIVE,
    ("POST", "/v1/recv/{kind}/{oid}/lacking"): RECEIVE_ASK,
    ("POST", "/v1/recv/{kind}/{oid}/commit"): RECEIVE,
    ("POST", "/v1/versions"): Rule(frozenset({"host"}), STAFF, grants=PUSHING, target="body"),
    ("POST", "/v1/fleet/pull"): HOST,
    ("POST", "/v1/fleet/restore"): HOST,    # a rollout --via: the repository's key and S3 credentials in the body
    ("POST", "/v1/grants/host"): HOST,      # a user's token only: a grant never makes grants
    ("DELETE", "/v1/grants/self"): GRANT_ONLY,
    ("GET", "/v1/fleet/activity"): LOOK_OR_HOST,
    ("POST", "/v1/verify"): HOST_READS,
    ("POST", "/v1/backups/{name}/prune"): HOST,
    ("POST", "/v1/capsules/{name}/start"): ACT,
    ("POST", "/v1/run"): ACT_STAFF,
    ("POST", "/v1/capsules/{name}/activate"): ACT,
    ("POST", "/v1/capsules/{name}/stop"): ACT,
    # the byte tunnel of a live move (tunnelapi.py, capsule/exchange/tunnel.py): what receiving a capsule needs, no
    # grant; a session serves only the token that opened it (checked by the route, before a byte reaches its target)
    ("POST", "/v1/tunnel"): HOST,
    ("DELETE", "/v1/tunnel/{session}"): HOST,
    ("WS", "/v1/tunnel/{session}/{channel}"): HOST,
    # pods: the destination side of `pod migrate --on HOST` (the capsule is in the body: staff only)
    ("GET", "/v1/pods"): Rule(frozenset({"read", "capsules", "admin", "host"}), STAFF),
    ("POST", "/v1/pods/restore"): Rule(frozenset({"capsules", "host"}), STAFF),
    # live moves: the destination side of `capsule migrate` (the capsule is in the body: staff only, no grant)
    ("POST", "/v1/live/check"): Rule(frozenset({"capsules", "host"}), STAFF, changes=False),
    ("POST", "/v1/live/prepare"): Rule(frozenset({"capsules", "host"}), STAFF),
    ("POST", "/v1/live/{mid}/finish"): Rule(frozenset({"capsules", "host"}), STAFF),
    ("POST", "/v1/live/{mid}/abort"): Rule(frozenset({"capsules", "host"}), STAFF),
    ("POST", "/v1/live/{mid}/recover"): Rule(frozenset({"capsules", "host"}), STAFF),
    # -- the dashboard (dashboard.py) --
    ("POST", "/api/session"): Rule(public=True),           # sign-in: audited, bounded (sessions.Attempts)
    ("GET", "/api/session"): ANY,
    ("DELETE", "/api/session"): ANY,
    ("GET", "/api/capsules"): LOOK_OR_HOST,        # also a peer's dashboard asking with this host's token
    ("GET", "/api/hosts"): LOOK,
    ("GET", "/api/tree"): LOOK_STAFF,
    ("GET", "/api/hosts/{host}/tree"): LOOK_STAFF,     # asked of the peer with this host's token for it
    ("POST", "/api/capsules/{name}/start"): ACT,
    ("POST", "/api/capsules/{name}/suspend"): ACT,
    ("POST", "/api/capsules/{name}/snapshot"): ACT,
    ("POST", "/api/capsules/{name}/stop"): ACT,
    ("POST", "/api/capsules/{name}/derive"): ACT,
    ("POST", "/api/capsules/{name}/rm"): ACT,
    **{(m, "/api/{rest:path}"): ANY for m in ("GET", "POST", "PUT", "PATCH", "DELETE")},   # 404 when signed in
    # -- consoles (capsule/console/routes.py, relay.py): the ticket is asked for with the rule; the WebSocket needs both
    ("POST", "/api/capsules/{name}/console-ticket"): Rule(frozenset({"capsules"}), capsule="name", changes=False),
    ("WS", "/api/console/{name}"): ACT,
    ("WS", "/api/console/{name}/serial"): ACT,
    # the guest's clipboard (capsule/console/clipboard.py): what the guest holds is its owner's, like its screen
    ("GET", "/api/capsules/{name}/clipboard"): ACT,
    ("PUT", "/api/capsules/{name}/clipboard"): ACT,
    ("PUT", "/api/capsules/{name}/screen-size"): ACT,      # its screen's resolution (capsule/console/screensize.py)
    ("POST", "/api/hosts/{host}/capsules/{name}/console-ticket"): Rule(frozenset({"capsules"}), STAFF,
                                                                       changes=False),
    ("WS", "/api/hosts/{host}/console/{name}"): ACT_STAFF,
    ("WS", "/api/hosts/{host}/console/{name}/serial"): ACT_STAFF,
    ("GET", "/api/hosts/{host}/capsules/{name}/clipboard"): ACT_STAFF,   # asked of the peer with this host's token
    ("PUT", "/api/hosts/{host}/capsules/{name}/clipboard"): ACT_STAFF,
    ("PUT", "/api/hosts/{host}/capsules/{name}/screen-size"): ACT_STAFF,
    # -- migrations (migrations.py) --
    ("POST", "/api/capsules/{name}/migrate"): ACT,
    ("GET", "/api/capsules/{name}/migrate/check"): ACT,
    ("GET", "/api/migrations"): LOOK,
    ("GET", "/api/migrations/{mid}"): MIGRATION_LOOK,
    ("GET", "/api/migrations/{mid}/events"): MIGRATION_LOOK,
    ("POST", "/api/migrations/{mid}/cancel"): MIGRATION_ACT,
    # Bring here (bringapi.py): this agent acts on the peer with its own token for it, so staff only (as the relay)
    ("GET", "/api/hosts/{host}/capsules/{name}/bring/check"): Rule(frozenset({"capsules"}), STAFF),
    ("POST", "/api/hosts/{host}/capsules/{name}/bring"): ACT_STAFF,
    ("GET", "/api/hosts/{host}/migrations/{mid}"): LOOK_STAFF,
    ("GET", "/api/hosts/{host}/migrations/{mid}/events"): LOOK_STAFF,
    ("POST", "/api/hosts/{host}/migrations/{mid}/cancel"): ACT_STAFF,
    # -- backups (backupsapi.py) --
    ("GET", "/api/backups"): LOOK,
    ("POST", "/api/backups/verify"): ACT_STAFF,
    ("POST", "/api/backups/{name}/run"): ACT,
    ("POST", "/api/backups/{name}/restore"): ACT,
    # -- the page and its files --
    ("GET", "/"): PUBLIC,
    ("GET", "/openapi.json"): PUBLIC,
    ("MOUNT", "/web"): PUBLIC,
    ("MOUNT", "/web/vendor/novnc"): PUBLIC,
    ("MOUNT", "/web/vendor/xterm"): PUBLIC,
}
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
NO_ROUTE = Rule(public=True, changes=False)   # a path no rule names: no route serves it (the router answers 404)


def _compile() -> list[tuple[str, str, Rule, re.Pattern[str], dict[str, Any]]]:
    out = []
    for (method, path), rule in RULES.items():
        if method == "MOUNT":
            continue
        regex, _fmt, convertors = compile_path(path)
        out.append((method, path, rule, regex, convertors))
    out.sort(key=lambda e: ":path}" in e[1])           # the catch-all after every other route, as registered
    return out


_TABLE = _compile()
_MOUNTS = sorted((p for m, p in RULES if m == "MOUNT"), key=len, reverse=True)


def match(kind: str, path: str) -> tuple[tuple[str, str] | None, dict[str, Any]]:
    """The :data:`RULES` key of a request (``kind``: its method, or ``WS``) and its path parameters; ``(None,
    {})`` when no rule names it. Matched here with Starlette's own path compiler, independent of how the routers
    were included; ``tests/unit/test_authz_routes.py`` checks every route of the app lands on its own rule."""
    kind = "GET" if kind == "HEAD" else kind
    for prefix in _MOUNTS:
        if path == prefix or path.startswith(prefix + "/"):
            return ("MOUNT", prefix), {}
    for method, template, _rule, regex, convertors in _TABLE:
        m = regex.match(path)
        if m and method == kind:
            return (method, template), {k: convertors[k].convert(v) for k, v in m.groupdict().items()}
    return None, {}


def routes_of(app: FastAPI) -> list[tuple[str, str]]:
    """Every (method or ``WS`` or ``MOUNT``, path) the app serves, its included routers flattened."""
    out: list[tuple[str, str]] = []

    def walk(routes: list[Any], prefix: str = "") -> None:
        for r in routes:
            contexts = getattr(r, "effective_route_contexts", None)
            if contexts is not None:        # FastAPI's included router
                for c in contexts():
                    methods = getattr(c.original_route, "methods", None)
                    path = getattr(c, "path", "") or getattr(c.starlette_route, "path", "")
                    out.extend([(m, path) for m in sorted(methods) if m != "HEAD"] if methods else [("WS", path)])
            elif isinstance(r, Mount):
                out.append(("MOUNT", prefix + r.path))
            elif getattr(r, "methods", None):
                out.extend((m, prefix + r.path) for m in sorted(r.methods) if m != "HEAD")
            else:
                out.append(("WS", prefix + r.path))

    walk(app.router.routes)
    return out


def check_rules(app: FastAPI) -> None:
    """Every route of ``app`` has its rule, and :func:`match` finds that rule for it (else the agent must not
    run: a route without a rule would be served to anyone)."""
    for key in routes_of(app):
        probe = re.sub(r"\{[^}:]+:path\}", "a/b", re.sub(r"\{[^}:]+\}", "x", key[1]))
        found, _ = match(key[0] if key[0] != "MOUNT" else "GET", probe)
        if key not in RULES or found != key:
            raise Internal(f"no authorization rule for {key[0]} {key[1]} (capsule/agent/authz.py RULES)")
        rule = RULES[key]
        if rule.target == "object" and not {"{kind}", "{oid}"} <= set(re.findall(r"\{[^}]+\}", key[1])) or (
                rule.target == "version" and "{number}" not in key[1]) or (rule.target and not rule.grants):
            raise Internal(f"the rule for {key[0]} {key[1]} names a grant target its path does not have")


def caller_of(request: HTTPConnection) -> Caller | None:
    return request.scope.get("state", {}).get("caller")


def grant_of(request: HTTPConnection) -> Grant | None:
    """The grant making the call, if a grant makes it (what a push's receiver may tell it is limited by it)."""
    c = caller_of(request)
    return c.principal.grant if c else None


def visible(request: Request, store: Store) -> set[str] | None:
    """The capsules the caller may see: None for all (operators, admins), else the ones it owns."""
    c = caller_of(request)
    p = c.principal if c else None
    if p is None or p.sees_all():
        return None
    return owners.owned_by(store, p.user) if p.user else set()


def adopt(request: Request, store: Store, capsule: str) -> None:
    """The caller made ``capsule`` (derive, restore as a new capsule): a user becomes its owner."""
    c = caller_of(request)
    if c is not None and c.principal.user is not None and store.catalogue.capsule(capsule) is not None:
        owners.set_owner(store, capsule, c.principal.user)


def check(store: Store, principal: Principal, rule: Rule, capsule: str | None,
          params: dict[str, Any] | None = None) -> None:
    """Refuse (:class:`Forbidden`) a call ``rule`` does not allow ``principal`` to make (``params``: the call's
    path parameters, where a grant's target is)."""
    if principal.grant is not None:
        check_grant(store, principal.grant, rule, params or {})
        return
    if not rule.roles:
        raise Forbidden("only a grant makes this call (on itself); a user's token is revoked with "
                        "`capsule token revoke ID`")
    if rule.scopes and not principal.scopes & rule.scopes:
        raise Forbidden(f"this call needs a token with scope {' or '.join(sorted(rule.scopes))}; this one has "
                        f"{', '.join(sorted(principal.scopes)) or 'none'}")
    if principal.role not in rule.roles:
        raise Forbidden(f"this call is for {' and '.join(sorted(r + 's' for r in rule.roles))}; "
                        f"{principal.who} is an {principal.role}")
    if capsule is not None and not principal.sees_all() and (
            principal.user is None or owners.owner_of(store, capsule) != principal.user):
        raise Forbidden(f"capsule {capsule[:64]!r} is not yours: an owner acts only on the capsules it owns")


def check_grant(store: Store, g: Grant, rule: Rule, params: dict[str, Any]) -> None:
    """A grant makes a call only where the rule serves its capability, and only on its own target."""
    if g.allow not in rule.grants:
        raise Forbidden(f"a grant ({g.describe()}) cannot make this call: a grant "
                        f"{'reads the objects of its capsule or version' if g.allow == READ else 'receives one push'}"
                        f" and nothing else")
    if rule.target == "object":
        check_object(store, g, str(params.get("kind", "")), str(params.get("oid", "")))
    elif rule.target == "version":
        name, number = str(params.get("name", "")), str(params.get("number", ""))
        if not grants.covers_version(store, g, name, number):
            raise Forbidden(f"version {name[:64]}@{number[:16]} is not what this grant ({g.describe()}) reads")


def check_object(store: Store, g: Grant, kind: str, oid: str) -> None:
    if not grants.covers(store, g, kind, oid):
        raise Forbidden(_not_covered(g, kind, oid))


def _not_covered(g: Grant, kind: str, oid: str) -> str:
    return (f"{kind[:16]} {oid[:12]} is not an object of {g.capsule}{'' if g.version is None else f'@{g.version}'}"
            f": this grant ({g.describe()}) reaches only those")


def check_record(conn: Request, store: Store, record: Any) -> None:
    """A route whose rule's target is ``body`` (``POST /v1/versions``): a grant records only the version record
    it was made for."""
    c = caller_of(conn)
    g = c.principal.grant if c else None
    if g is not None and not grants.covers_record(g, record):
        raise Forbidden(f"this grant ({g.describe()}) records only the version it was made for")


class StreamGate:
    """The block stream's per-message check (``WS /v1/objects/stream``): the caller admitted at the upgrade is
    checked again every :data:`RECHECK` seconds (a revoked token or grant stops the stream), and a grant may read
    only its own objects. A refusal is an error reply; the connection stays usable."""

    RECHECK = 5.0

    def __init__(self, ws: WebSocket, store: Store, token: str) -> None:
        self.ws, self.store, self.token = ws, store, token
        c = caller_of(ws)
        self.principal = c.principal if c else None
        self.checked = time.monotonic()

    async def admit(self, kind: str, oid: str) -> None:
        if self.principal is None:
            raise AuthFailed("missing or wrong bearer token")
        if time.monotonic() - self.checked > self.RECHECK:
            bearer = self.ws.headers.get("authorization", "").partition(" ")[2]
            self.principal = await anyio.to_thread.run_sync(tokens.resolve, self.store, bearer, self.token)
            self.checked = time.monotonic()
        g = self.principal.grant
        if g is None:
            return
        known = grants.covered(self.store, g, kind, oid)     # a cached answer: no thread hop, no catalogue
        if known is None:
            await anyio.to_thread.run_sync(check_object, self.store, g, kind, oid)
        elif not known:
            raise Forbidden(_not_covered(g, kind, oid))
