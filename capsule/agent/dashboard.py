"""The dashboard: its JSON API under ``/api/`` and the page (``web/``) at ``/``.

Every ``/api`` call needs a session (sign in with a user name and password, or with the host's token while no admin
user exists: ``POST /api/session``) or a token as a bearer token; without one the answer is 401 and nothing else.
What each call needs (role, scope, owning the capsule) is in :mod:`capsule.agent.authz`, which checks it first.
Each action is the library call the CLI makes (``capsule.lifecycle``, ``capsule.capsules``, ``capsule.hierarchy``,
``capsule.hosts``) and answers what the CLI prints under ``--json`` (``capsule.views``); this module holds no
logic of its own.

    POST   /api/session                     sign in {"user", "password"} or {"token"} → cookie + CSRF token
    GET    /api/session                     who is signed in (and the CSRF token again)
    DELETE /api/session                     sign out
    GET    /api/capsules                    this host's capsules: state, versions, sizes, depends-on
    GET    /api/hosts                       the peers, each with its capsules or why it is unreachable
    GET    /api/tree                        the hierarchy: layers, images, versions, memory images, instances
    GET    /api/hosts/{host}/tree           a peer's hierarchy, asked of it with this host's token for it
    POST   /api/capsules/{name}/start       {version, wait, timeout}
    POST   /api/capsules/{name}/suspend     {balloon, balloon_policy, balloon_method}
    POST   /api/capsules/{name}/snapshot    same
    POST   /api/capsules/{name}/stop        {timeout, force}
    POST   /api/capsules/{name}/derive      {child, version}
    POST   /api/capsules/{name}/rm          {version, promote}
    POST   /api/capsules/{name}/console-ticket, WS /api/console/{name}: the live console (``capsule/console/routes.py``)
    POST   /api/capsules/{name}/migrate     {to, mode, balloon} → a migration; /api/migrations/… (migrations.py)
    POST   /api/hosts/{host}/capsules/{name}/bring   a peer's capsule migrated here; its progress (bringapi.py)
    GET    /api/backups, POST /api/backups/{name}/run|restore, /api/backups/verify (backupsapi.py)

Installed into the agent by :func:`install` (one call in ``create_app``). New ``/api`` routes go into
:func:`api_router`, before its catch-all (which answers 401 to a caller without a session, and 404 to one
with a session, for any other ``/api`` path)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from capsule import capsules, hierarchy, hosts, lifecycle, views
from capsule.agent import authz, backupsapi, bringapi, migrations, signin
from capsule.agent.apimodels import (
    CapsuleOut,
    DeriveIn,
    HostOut,
    RmIn,
    RmOut,
    SealIn,
    SealOut,
    SessionOut,
    SignIn,
    SnapshotOut,
    StartIn,
    StartOut,
    StopIn,
    TreeOut,
    VersionOut,
)
from capsule.agent.sessions import Attempts, Caller, Sessions, check_same_origin
from capsule.agent.workers import Workers
from capsule.console import routes as console_routes
from capsule.names import check_name
from capsule.store import Store

PEER_TIMEOUT = 3.0
# the page's own files; CAPSULE_WEB_DIR points elsewhere (an installed copy)
WEB_DIR = Path(os.environ.get("CAPSULE_WEB_DIR", Path(__file__).resolve().parents[2] / "web"))
# the page loads only its own scripts and styles, talks only to its own agent, is never framed
PAGE_HEADERS = {
    # style-src 'unsafe-inline': the serial console (xterm.js) sizes and colours its cells with a <style> it writes
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
                               "object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def install(app: FastAPI, store: Store, token: str) -> None:
    """Add the dashboard to an agent app: the API, the page at ``/`` and its files under ``/web/``."""
    sessions = Sessions(token, store.id, live=signin.live(store))   # a password changed ends its sessions
    app.state.sessions = sessions
    app.state.sign_in_attempts = Attempts()
    app.state.sign_in_pool = signin.HashPool()
    console_routes.install(app, store, sessions)  # the live console (capsule/console/routes.py), before the catch-all
    app.state.migrations = migrations.Migrations()      # authz finds a migration's capsule here
    app.include_router(migrations.router(store, sessions, token, app.state.migrations))  # before api_router's catch-all
    app.include_router(backupsapi.router(store, sessions))          # (also)
    app.include_router(bringapi.router(store, sessions))            # (also): Bring here, a peer's capsule
    app.include_router(api_router(store, sessions, app.state.sign_in_attempts, app.state.sign_in_pool,
                                  app.state.workers))

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", headers=PAGE_HEADERS)

    if WEB_DIR.is_dir():
        app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")


def api_router(store: Store, sessions: Sessions, attempts: Attempts, pool: signin.HashPool,
               workers: Workers) -> APIRouter:
    act = workers.act       # capsule operations: in the lifecycle pool, counted per owner (workers.py)

    def caller(request: Request, response: Response) -> Caller:
        response.headers["Cache-Control"] = "no-store"
        request.state.caller = sessions.authenticate(request)
        return request.state.caller

    signed_in = [Depends(caller)]
    public = APIRouter(prefix="/api", tags=["dashboard"])
    router = APIRouter(prefix="/api", tags=["dashboard"], dependencies=signed_in)

    def session_out(c: Caller) -> SessionOut:
        who = {"user": c.principal.user, "role": c.principal.role}
        if c.session is None:
            return SessionOut(store_id=store.id, csrf=None, expires_in=None, **who)
        return SessionOut(store_id=store.id, csrf=c.session.csrf, expires_in=sessions.expires_in(c.session), **who)

    # -- sign-in ---------------------------------------------------------------------------------------
    @public.post("/session", response_model=SessionOut, summary="Sign in with a user name and password "
                                                                 "(or the host's token, until an admin exists)")
    async def sign_in(body: SignIn, request: Request, response: Response) -> SessionOut:
        """Failed attempts are bounded per client address and per user name, checked before the password is
        (429 with Retry-After); passwords are checked a few at a time (429 when too many wait)."""
        response.headers["Cache-Control"] = "no-store"
        check_same_origin(request)
        if body.user is not None:
            request.state.audit_who = body.user
        s = await signin.sign_in(store, sessions, attempts, pool, address=request.client.host if request.client
                                 else "?", user=body.user, password=body.password, token=body.token)
        response.set_cookie(sessions.cookie, s.sid, max_age=int(sessions.lifetime), path="/", httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")
        request.state.audit_who = s.principal.who
        return session_out(Caller(s, s.principal))

    @router.get("/session", response_model=SessionOut, summary="The current session")
    def session(request: Request) -> SessionOut:
        return session_out(request.state.caller)

    @router.delete("/session", status_code=204, summary="Sign out")
    def sign_out(request: Request) -> Response:
        c: Caller = request.state.caller
        if c.session is not None:
            sessions.end(c.session)
        response = Response(status_code=204)
        response.delete_cookie(sessions.cookie, path="/", httponly=True, samesite="strict",
                               secure=request.url.scheme == "https")
        return response

    # -- what is where ---------------------------------------------------------------------------------
    @router.get("/capsules", response_model=list[CapsuleOut], summary="This host's capsules (an owner's: theirs)")
    async def capsule_list(request: Request) -> list[dict[str, Any]]:
        def work() -> list[dict[str, Any]]:
            rows = views.overview(store, hosts.name_for_url(hosts.peers(store)))
            mine = authz.visible(request, store)
            return rows if mine is None else [r for r in rows if r["name"] in mine]

        return await asyncio.to_thread(work)

    @router.get("/hosts", response_model=list[HostOut], summary="The peers and their capsules")
    async def host_list(request: Request) -> list[dict[str, Any]]:
        """Every peer is asked at once for its ``/api/capsules``; one that does not answer within a few
        seconds, or answers something unusable, is marked unreachable with the reason. An owner sees none (the
        peers' capsules are not theirs here)."""
        if authz.visible(request, store) is not None:
            return []
        statuses = await asyncio.to_thread(hosts.ask_all, store, "/api/capsules", timeout=PEER_TIMEOUT)
        out = []
        for st in statuses:
            row = st.as_dict() | {"capsules": None}
            if st.reachable:
                try:
                    row["capsules"] = [CapsuleOut.model_validate(c) for c in st.answer]
                except (ValueError, TypeError) as exc:
                    row |= {"reachable": False, "error": f"unusable answer from the host: {str(exc)[:200]}"}
            out.append(row)
        return out

    @router.get("/tree", response_model=TreeOut, summary="This host's hierarchy (the paper's Fig. 1)")
    async def tree() -> dict[str, Any]:
        """Layers with their parents, images, capsules, versions with their chains, memory images and running
        instances: what `capsule tree --json` prints."""
        return await asyncio.to_thread(views.tree_dict, store)

    @router.get("/hosts/{host}/tree", response_model=TreeOut, summary="A peer's hierarchy, asked through this host")
    async def peer_tree(host: str) -> dict[str, Any]:
        """What the peer's ``GET /api/tree`` answers (so a user sees which versions exist where); an unknown
        host is 404, a peer that does not answer within a few seconds 502 with the reason."""
        return await asyncio.to_thread(hosts.ask_one, store, host, "/api/tree", timeout=PEER_TIMEOUT)

    # -- actions: one library call each ----------------------------------------------------------------
    @router.post("/capsules/{name}/start", response_model=StartOut, summary="Boot or restore a capsule")
    async def start(name: str, body: StartIn, request: Request) -> dict[str, Any]:
        ref = check_name(name) if body.version is None else f"{check_name(name)}@{body.version}"
        r = await act(request, lifecycle.start, store, ref, wait=body.wait, timeout=body.timeout)
        return views.start_dict(r)

    @router.post("/capsules/{name}/suspend", response_model=SealOut, summary="Suspend a running capsule")
    async def suspend(name: str, body: SealIn, request: Request) -> dict[str, Any]:
        r = await act(request, lifecycle.suspend, store, check_name(name), balloon=_policy(body),
                      balloon_method=body.balloon_method)
        return views.seal_dict(r)

    @router.post("/capsules/{name}/snapshot", response_model=SnapshotOut, summary="Snapshot a running capsule")
    async def snapshot(name: str, body: SealIn, request: Request) -> dict[str, Any]:
        sealed, resumed = await act(request, lifecycle.snapshot, store, check_name(name), balloon=_policy(body),
                                    balloon_method=body.balloon_method)
        return views.seal_dict(sealed) | {"resumed": views.start_dict(resumed)}

    @router.post("/capsules/{name}/stop", response_model=SealOut, summary="Shut a capsule down")
    async def stop(name: str, body: StopIn, request: Request) -> dict[str, Any]:
        r = await act(request, lifecycle.stop, store, check_name(name), timeout=body.timeout, force=body.force)
        return views.seal_dict(r)

    @router.post("/capsules/{name}/derive", response_model=VersionOut, summary="Derive a child capsule")
    async def derive(name: str, body: DeriveIn, request: Request) -> dict[str, Any]:
        ref = check_name(name) if body.version is None else f"{check_name(name)}@{body.version}"
        v = await act(request, capsules.derive, store, ref, body.child)
        authz.adopt(request, store, body.child)     # the child is the caller's
        return views.version_dict(store, v, progress=False)

    @router.post("/capsules/{name}/rm", response_model=RmOut, summary="Remove a capsule or one version")
    async def rm(name: str, body: RmIn, request: Request) -> dict[str, Any]:
        ref = check_name(name) if body.version is None else f"{check_name(name)}@{body.version}"
        r = await act(request, hierarchy.rm, store, ref, promote_dependants=body.promote)
        return views.rm_dict(r)

    # a route that does not exist under /api is a 401 too for a caller without a session
    @router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    def unknown(rest: str) -> None:
        raise HTTPException(status_code=404, detail=f"no API call /api/{rest}")

    outer = APIRouter()
    outer.include_router(public)
    outer.include_router(router)
    return outer


def _policy(body: SealIn) -> str | None:
    return body.balloon_policy if body.balloon else None
