"""The guard: the ASGI middleware that applies :mod:`capsule.agent.authz` to every request (HTTP and WebSocket)
before any route runs — it finds the request's rule, authenticates the caller, has :func:`authz.check` decide —
and appends the audit line of every change, console ticket and console opened (``capsule.agent.auditlog``, which
counts a refusal repeated rather than writing it again): who, what, which capsule, from where, the result."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio
from fastapi import FastAPI, HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from capsule.accounts import tokens, users
from capsule.accounts.model import ROLE_SCOPES, Principal
from capsule.agent.auditlog import AuditLog, handshake_refusal, relayed_capsule
from capsule.agent.authz import NO_ROUTE, READ_METHODS, RULES, Rule, check, match
from capsule.agent.sessions import CSRF_HEADER, Caller, Sessions, check_same_origin, forbidden, unauthorized
from capsule.errors import AuthFailed, Error
from capsule.store import Store
from hashcache.errors import error_class

Scope = MutableMapping[str, Any]
ASGI = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class Guard:
    """The ASGI middleware that authenticates, authorizes and audits every call (see :mod:`capsule.agent.authz`)."""

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
            grant = caller.principal.grant is not None
            if grant:      # decided by its capability and target alone, before anything is looked up for it
                check(self.store, caller.principal, rule, None, params)
            name = self.capsule_of(rule, params)
            state["capsule"] = name
            if not grant:
                check(self.store, caller.principal, rule, name, params)
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
            if isinstance(conn, WebSocket):
                if "websocket.http.response" in scope.get("extensions", {}):
                    await conn.send_denial_response(reply)
                else:
                    await conn.close(code=1008)
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
