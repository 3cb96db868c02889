"""Who may call what: the ONE table of the agent's routes and what each needs, and the ASGI guard that applies it
to every request (HTTP and WebSocket) before any route runs, and writes the audit line of every change.

A rule says which token scopes a call accepts (any one of them), which roles may make it, and, for a call on one
capsule, where its name is: an ``owner`` acts only on capsules it owns; operators and admins on all. The guard:

1. finds the request's rule (:func:`match`, with Starlette's path compiler); ``create_app`` refuses to make an
   agent with a route no rule names (:func:`check_rules`), and a unit test walks the app's routes too;
2. authenticates: ``Authorization: Bearer`` (a user's token, or the old host token while no admin user exists),
   else the dashboard's session cookie (+ CSRF token and same-origin check on a change);
3. authorizes: scope, role, ownership → :class:`Forbidden` (403) naming what was missing;
4. for a call that changes something (every non-GET route but the few that only read), and for every console
   ticket and console opened, appends one line to the audit log (``capsule.agent.auditlog``, which counts a
   refusal repeated rather than writing it again): who, what, which capsule, from where, and the result.

Refusals are the agent's usual JSON errors; a dashboard call without a valid session gets the one bare 401."""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, compile_path
from starlette.websockets import WebSocket

from capsule.accounts import owners, tokens, users
from capsule.accounts.model import ROLE_SCOPES, Principal
from capsule.agent.auditlog import AuditLog, handshake_refusal, relayed_capsule
from capsule.agent.sessions import CSRF_HEADER, Caller, Sessions, check_same_origin, forbidden, unauthorized
from capsule.errors import AuthFailed, Error, Forbidden, Internal
from capsule.store import Store
from hashcache.errors import error_class

Scope = MutableMapping[str, Any]
ASGI = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

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

RULES: dict[tuple[str, str], Rule] = {
    # -- HCP and host-to-host (capsule/agent/app.py) --
    ("GET", "/v1/info"): LOOK_OR_HOST,
    ("GET", "/v1/capsules"): LOOK_OR_HOST,
    ("GET", "/v1/capsules/{name}/versions/{number}"): Rule(LOOK_OR_HOST.scopes, capsule="name"),
    ("POST", "/v1/objects/missing"): HOST_READS,
    ("GET", "/v1/objects/{kind}/{oid}"): HOST,
    ("GET", "/v1/objects/{kind}/{oid}/records"): HOST,
    ("POST", "/v1/objects/{kind}/{oid}/read"): HOST_READS,
    ("WS", "/v1/objects/stream"): HOST,
    ("POST", "/v1/recv/{kind}/{oid}/begin"): HOST,
    ("POST", "/v1/recv/{kind}/{oid}/blocks"): HOST,
    ("POST", "/v1/recv/{kind}/{oid}/commit"): HOST,
    ("POST", "/v1/versions"): HOST,
    ("POST", "/v1/fleet/pull"): HOST,
    ("POST", "/v1/grants/host"): HOST,      # a grant no stronger than the caller's own host calls, expiring
    ("GET", "/v1/fleet/activity"): LOOK_OR_HOST,
    ("POST", "/v1/verify"): HOST_READS,
    ("POST", "/v1/backups/{name}/prune"): HOST,
    ("POST", "/v1/capsules/{name}/start"): ACT,
    ("POST", "/v1/run"): ACT_STAFF,
    ("POST", "/v1/capsules/{name}/activate"): ACT,
    ("POST", "/v1/capsules/{name}/stop"): ACT,
    # pods: the destination side of `pod migrate --host` (the capsule is in the body: staff only)
    ("GET", "/v1/pods"): Rule(frozenset({"read", "capsules", "admin", "host"}), STAFF),
    ("POST", "/v1/pods/restore"): Rule(frozenset({"capsules", "host"}), STAFF),
    # -- the dashboard (dashboard.py) --
    ("POST", "/api/session"): Rule(public=True),           # sign-in: audited, bounded (sessions.Attempts)
    ("GET", "/api/session"): ANY,
    ("DELETE", "/api/session"): ANY,
    ("GET", "/api/capsules"): LOOK_OR_HOST,        # also a peer's dashboard asking with this host's token
    ("GET", "/api/hosts"): LOOK,
    ("GET", "/api/tree"): LOOK_STAFF,
    ("POST", "/api/capsules/{name}/start"): ACT,
    ("POST", "/api/capsules/{name}/suspend"): ACT,
    ("POST", "/api/capsules/{name}/snapshot"): ACT,
    ("POST", "/api/capsules/{name}/stop"): ACT,
    ("POST", "/api/capsules/{name}/derive"): ACT,
    ("POST", "/api/capsules/{name}/rm"): ACT,
    **{(m, "/api/{rest:path}"): ANY for m in ("GET", "POST", "PUT", "PATCH", "DELETE")},   # 404 when signed in
    # -- consoles (console.py, consolerelay.py): the ticket is asked for with the rule; the WebSocket needs both
    ("POST", "/api/capsules/{name}/console-ticket"): Rule(frozenset({"capsules"}), capsule="name", changes=False),
    ("WS", "/api/console/{name}"): ACT,
    ("WS", "/api/console/{name}/serial"): ACT,
    ("POST", "/api/hosts/{host}/capsules/{name}/console-ticket"): Rule(frozenset({"capsules"}), STAFF,
                                                                       changes=False),
    ("WS", "/api/hosts/{host}/console/{name}"): ACT_STAFF,
    ("WS", "/api/hosts/{host}/console/{name}/serial"): ACT_STAFF,
    # -- migrations (migrations.py) --
    ("POST", "/api/capsules/{name}/migrate"): ACT,
    ("GET", "/api/migrations"): LOOK,
    ("GET", "/api/migrations/{mid}"): MIGRATION_LOOK,
    ("GET", "/api/migrations/{mid}/events"): MIGRATION_LOOK,
    ("POST", "/api/migrations/{mid}/cancel"): MIGRATION_ACT,
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


def caller_of(request: Request | WebSocket) -> Caller | None:
    return request.scope.get("state", {}).get("caller")


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


def check(store: Store, principal: Principal, rule: Rule, capsule: str | None) -> None:
    """Refuse (:class:`Forbidden`) a call ``rule`` does not allow ``principal`` to make."""
    if rule.scopes and not principal.scopes & rule.scopes:
        raise Forbidden(f"this call needs a token with scope {' or '.join(sorted(rule.scopes))}; this one has "
                        f"{', '.join(sorted(principal.scopes)) or 'none'}")
    if principal.role not in rule.roles:
        raise Forbidden(f"this call is for {' and '.join(sorted(r + 's' for r in rule.roles))}; "
                        f"{principal.who} is an {principal.role}")
    if capsule is not None and not principal.sees_all() and (
            principal.user is None or owners.owner_of(store, capsule) != principal.user):
        raise Forbidden(f"capsule {capsule[:64]!r} is not yours: an owner acts only on the capsules it owns")


class Guard:
    """The ASGI middleware that authenticates, authorizes and audits every call (see the module's text)."""

    def __init__(self, app: ASGI, *, fastapi: FastAPI, store: Store, sessions: Sessions, token: str) -> None:
        self.app, self.fastapi, self.store, self.sessions, self.token = app, fastapi, store, sessions, token
        self.audit_log: AuditLog = getattr(fastapi.state, "audit_log", None) or AuditLog(store.home)

    def _principal_live(self, p: Principal) -> Principal:
        """A session's principal as of now: the old host token ends with the first admin; a removed user ends."""
        if p.user is None:
            if users.admin_exists(self.store):
                raise AuthFailed(tokens.LEGACY_GONE)
            return p
        try:
            role = users.get(self.store, p.user).role
        except Error:
            raise AuthFailed("this user no longer exists") from None
        return Principal(p.user, role, p.scopes & ROLE_SCOPES[role], p.token_id)

    def authenticate(self, conn: Request | WebSocket, api: bool) -> Caller:
        auth = conn.headers.get("authorization")
        if auth is not None:
            scheme, _, bearer = auth.partition(" ")
            try:
                if scheme != "Bearer" or not bearer:
                    raise AuthFailed("missing or wrong bearer token")
                return Caller(None, tokens.resolve(self.store, bearer, self.token))
            except AuthFailed as exc:
                if api and str(exc) == "missing or wrong bearer token":
                    raise unauthorized() from None
                raise
        if not api:      # host calls (/v1) take bearer tokens only, never a browser's cookie
            raise AuthFailed("missing or wrong bearer token")
        session = self.sessions.lookup(conn.cookies.get(self.sessions.cookie))
        if session is None:
            raise unauthorized()
        principal = self._principal_live(session.principal)
        if isinstance(conn, Request) and conn.method not in READ_METHODS:
            check_same_origin(conn)
            if not hmac.compare_digest(conn.headers.get(CSRF_HEADER, "").encode(), session.csrf.encode()):
                raise forbidden("missing or wrong CSRF token (send the X-CSRF-Token header the sign-in gave)")
        return Caller(session, principal)

    def capsule_of(self, rule: Rule, params: dict[str, Any]) -> str | None:
        if rule.capsule == "name":
            return str(params.get("name", ""))
        if rule.capsule == "migration":
            return self.fastapi.state.migrations.get(str(params.get("mid", ""))).capsule
        return None

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, self._stopping(receive) if scope["type"] == "lifespan" else receive, send)
            return
        ws = scope["type"] == "websocket"
        key, params = match("WS" if ws else scope["method"], scope["path"])
        rule = RULES[key] if key is not None else NO_ROUTE
        conn: Request | WebSocket = WebSocket(scope, receive, send) if ws else Request(scope, receive)
        audited = (not ws and scope["method"] not in READ_METHODS and rule.changes) or key in AUDITED_ALWAYS
        action = f"{scope.get('method', 'WS')} {key[1] if key else scope['path']}"
        remote = scope["client"][0] if scope.get("client") else None
        state = scope.setdefault("state", {})
        capsule: str | None = None

        def admit() -> str | None:     # catalogue reads: in a thread, never holding up the event loop
            caller = self.authenticate(conn, scope["path"].startswith("/api/") or scope["path"] == "/api")
            state["caller"] = caller
            name = self.capsule_of(rule, params)
            state["capsule"] = name
            check(self.store, caller.principal, rule, name)
            return name

        def audit_line(result: str) -> None:
            c = state.get("caller")
            who = c.principal.who if c else state.get("audit_who") or _who_tried(conn)
            self.audit_log.record(who=who, action=action, capsule=capsule or relayed_capsule(params), remote=remote,
                                  result=result)

        try:
            if not rule.public:
                capsule = await anyio.to_thread.run_sync(admit)
        except (Error, HTTPException) as exc:
            capsule = state.get("capsule")
            reply = _reply(exc)
            if audited:
                audit_line(_result(reply))
            if ws:
                if "websocket.http.response" in scope.get("extensions", {}):
                    await conn.send_denial_response(reply)   # type: ignore[union-attr]
                else:
                    await conn.close(code=1008)              # type: ignore[union-attr]
            else:
                await reply(scope, receive, send)
            return
        if not audited:
            await self.app(scope, receive, send)
            return
        seen: dict[str, Any] = {"status": 500, "body": b"", "recorded": False}

        def record(result: str | None = None) -> None:
            if seen["recorded"]:
                return
            seen["recorded"] = True
            audit_line(result or ("ok" if seen["status"] < 400 else _code(seen["status"], seen["body"])))

        async def watch(message: Any) -> None:
            kind = message["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                seen["status"] = message["status"]
            elif kind in ("http.response.body", "websocket.http.response.body"):
                if seen["status"] >= 400 and len(seen["body"]) < 4096:
                    seen["body"] += message.get("body", b"")
                if not message.get("more_body", False):
                    # before the answer's last byte leaves: whoever got the answer finds the line
                    record(handshake_refusal(seen["status"]) if ws else None)
            elif kind == "websocket.accept":
                record("ok")                 # a console opened
            elif kind == "websocket.close":
                record("closed_before_open")
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            record()   # (an app that failed before answering)

    def _stopping(self, receive: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        """The lifespan's ``receive``: when the agent stops, the refusals still being counted get their line."""
        async def wrapped() -> Any:
            message = await receive()
            if message.get("type") == "lifespan.shutdown":
                self.audit_log.close()
            return message

        return wrapped


# audited whatever the method: a console ticket asked for (a POST that changes nothing) and a console opened
AUDITED_ALWAYS = frozenset(k for k in RULES if k[1].endswith("/console-ticket") or "/console/" in k[1])


def _who_tried(conn: Request | WebSocket) -> str:
    return "anonymous" if conn.headers.get("authorization") is None else "unknown-token"


def _reply(exc: Error | HTTPException) -> JSONResponse:
    if isinstance(exc, HTTPException):
        cls = error_class(None, exc.status_code)
        return JSONResponse({"error": cls.code, "detail": str(exc.detail)}, status_code=exc.status_code,
                            headers=exc.headers)
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, AuthFailed) else None
    return JSONResponse(exc.to_wire(), status_code=exc.http_status, headers=headers)


def _result(reply: JSONResponse) -> str:
    return _code(reply.status_code, bytes(reply.body))


def _code(status: int, body: bytes) -> str:
    try:
        code = json.loads(body).get("error")
    except (ValueError, AttributeError):
        code = None
    return str(code)[:40] if isinstance(code, str) else f"http_{status}"
