"""The host agent's HTTP API (FastAPI). Every request carries a bearer token (a user's token, or the host's
token while no admin user exists); what each call needs — role, token scope, owning the capsule — is checked
before any route by :mod:`capsule.agent.authz`, which also writes the audit line of every change. The agent only
ever serves objects of its own store, named by validated ids, and every number a request gives (a query
parameter, a body field) is finite and within its bounds (:mod:`capsule.agent.bounded`, :mod:`capsule.bounds`)
or the request is refused with 400 before anything happens.

HCP calls (stateless, §4.4.3)::

    GET  /v1/objects/{kind}/{id}                 LOOKUP: manifest header (+ role of a file object)
    GET  /v1/objects/{kind}/{id}/records         READ-HASH: ?start=&count= raw records, zstd
    POST /v1/objects/{kind}/{id}/read            READ: body = varint block indices → zstd blocks
    WS   /v1/objects/stream                      READ, many per connection (demand paging's misses;
                                                 wire format in hashcache/hcp.py)

Receiving (push) — state lives in the object's shadow on disk, not in memory::

    POST /v1/recv/{kind}/{id}/begin              body = zstd(manifest) → zstd(varint indices still needed)
                                                 (?like=FILE&like_first=&like_last=&like_len=: the zstd is
                                                 against that file's records of those blocks, held here)
    POST /v1/recv/{kind}/{id}/blocks             body = u32 n, n bytes of varint indices, zstd blocks
    POST /v1/recv/{kind}/{id}/lacking            body = varint indices of a batch → those not kept (varints):
                                                 an upload whose answer was lost is sent again only for these
    POST /v1/recv/{kind}/{id}/commit             verify the digest, install, record

Management::

    GET  /v1/info, GET /v1/capsules, GET /v1/capsules/{name}/versions/{n|latest}
    POST /v1/objects/missing                     {"layers": [...], "files": [...]} → what this store lacks
    POST /v1/versions                            record a version whose objects have all arrived

Pods (the destination side of `capsule pod migrate --on HOST`)::

    GET  /v1/pods?capsule=C                      the pods of a running capsule here
    POST /v1/pods/restore                        {"image": ID, "into": C}: restart a pod image (pushed here) in C

Live moves (the destination side of `capsule migrate`, capsule/exchange/incoming.py)::

    POST /v1/live/check                          {capsule, type, cpu, host} → {refusals, postcopy, host}
    POST /v1/live/prepare                        {capsule, version, xml, disks, tunnel} → {id, domain, xml}
    POST /v1/live/{id}/finish, .../abort         the guest runs here / what prepare made is removed
    POST /v1/live/{id}/recover                   a post-copy that lost its link: QEMU here listens again

Fleet (capsule/exchange/fleet.py)::

    POST /v1/grants/host                         {"allow": "read", "capsule": C, "version": V, "expires_in": S}
                                                 or {"allow": "push", "record": R, "expires_in": S}
                                                 → {"token", "id", "expires", "allow", "capsule", "version", ...}:
                                                 a grant for one job (capsule/accounts/grants.py)
    DELETE /v1/grants/self                       the calling grant ends (its job is done)
    POST /v1/fleet/pull                          {"source": URL, "token": T, "ref": "NAME@V", "fingerprint": F,
                                                 "zstd_level": 1..19 (optional: by the link)}: pull it
    POST /v1/fleet/restore                       {"repository": s3://…, "ref": "NAME@V", "key": {"id", "master"},
                                                 "credentials": {"access_key", "secret_key"}}: restore it from a
                                                 repository (a rollout --via; capsule/exchange/fleetrepo.py)
    GET  /v1/fleet/activity                      this agent's recent pulls and what it served
    POST /v1/capsules/{name}/activate?version=V  run NAME@V here (a running older version is stopped)
    POST /v1/capsules/{name}/stop?discard=       stop it (keep its disk changes as a version, or drop them)
    POST /v1/verify                              re-hash what some versions reference (backup verify jobs)
    POST /v1/backups/{name}/prune                apply a retention policy to the backup copies held here

Live moves (capsule/agent/tunnelapi.py over capsule/exchange/tunnel.py)::

    POST   /v1/tunnel                            {"kinds": ["libvirt", "qemu-migration", "qemu-disks"], "ttl": S}
                                                 → {"session": ID, "channels": {KIND: {"path": P|null}}, ...}
    WS     /v1/tunnel/{session}/{channel}        one connection to the channel's unix socket here, bytes both ways
    DELETE /v1/tunnel/{session}                  end the session and its connections

Blocking work runs in one of two bounded thread pools (capsule/agent/workers.py): HCP and receiving in the serving
pool (``serve``), capsule operations in the lifecycle pool (``act``), where an owner has at most a few at once (429
``too_many_operations`` with Retry-After beyond that); lifecycle calls filling their pool never delay block serving.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capsule import __version__ as capsule_version
from capsule.accounts import grants, passwords
from capsule.agent import authz, dashboard, guard, protocol, tunnelapi
from capsule.agent.auditlog import AuditLog
from capsule.agent.bounded import (
    HashLenQuery,
    PartQuery,
    PartsQuery,
    RecordCountQuery,
    RecordStartQuery,
    SegmentQuery,
    TimeoutQuery,
    VersionQuery,
    ZstdLevelQuery,
)
from capsule.agent.limits import Limits
from capsule.agent.turns import Turns
from capsule.agent.workers import Workers
from capsule.backup import runner as backup_runner
from capsule.backup.retention import Policy
from capsule.errors import AuthFailed, Error, Internal, InvalidName
from capsule.exchange import fleet, fleetrepo, incoming, running, tunnel
from capsule.exchange.receiving import (
    MAX_BLOCKS_UPLOAD,
    MAX_LACKING_UPLOAD,
    MAX_MANIFEST_UPLOAD,
    Inbox,
    decode_manifest_upload,
    encode_plan,
)
from capsule.exchange.serving import MAX_RECORDS, ObjectServer, capsule_list, missing, version_of
from capsule.exchange.streams import CODECS, STREAMS_HEADER
from capsule.migrate.memrefs import StoreResolver
from capsule.names import check_object_id
from capsule.pod import ops as pod_ops
from capsule.store import Store
from capsule.transfer.records import record_version
from capsule.verify import users_of, verify_versions
from hashcache import wirejson
from hashcache.delta import DELTA_FORMAT, DELTAS_HEADER
from hashcache.errors import error_class
from hashcache.hcp import (
    LIKE_SPAN_HEADER,
    PREFIX_SIZE,
    decode_stream_read,
    encode_indices,
    encode_stream_error,
)

MAX_VERIFY = 10_000       # versions in one verify request


def _error_reply(exc: Error, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one mapping from an error to an answer: its class's status; ``{"error": code, "detail":
    message, ...fields}`` (see :mod:`hashcache.errors`)."""
    return JSONResponse(exc.to_wire(), status_code=exc.http_status, headers=headers)


def create_app(home: Path, token: str, limits: Limits | None = None) -> FastAPI:
    """The agent's app on the store at ``home``. ``limits``: its thread pools and the per-owner limit on capsule
    operations (``capsule/agent/workers.py``; the defaults of :class:`Limits` when not given)."""
    if not token or len(token) < 16:
        raise InvalidName("the agent's token must be at least 16 characters")
    app = FastAPI(title="Capsule host agent", version=capsule_version, docs_url=None, redoc_url=None)
    app.state.public_url = None     # the URL other hosts reach it at: set by `capsule serve` (serve.public_url)
    store = Store.open(home)
    passwords.dummy_hash()          # made now: the first unknown user's sign-in costs no more than a known one's
    app.state.workers = work = Workers(limits or Limits())
    serve, act = work.serve, work.act   # HCP and receiving; capsule operations (counted per owner)
    objects = ObjectServer(store)
    activity = fleet.Activity()
    inbox = Inbox(store)
    turns = Turns(inbox.streams)
    # One mapping from errors to answers: {"error": code, "detail": message, ...fields}, the class's status.
    @app.exception_handler(Error)
    async def _errors(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Error)
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, AuthFailed) else None
        retry_after = getattr(exc, "retry_after", None)
        if isinstance(retry_after, int):      # too many sign-ins, too many operations at once
            headers = {"Retry-After": str(retry_after)}
        return _error_reply(exc, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_errors(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        cls = error_class(None, exc.status_code)
        body = {"error": cls.code, "detail": str(exc.detail)}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', '')}"
                             for e in exc.errors())
        return _error_reply(InvalidName(f"malformed request: {problems}"))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        # (the server logs the traceback: this handler runs in its error middleware, which re-raises)
        return _error_reply(Internal(f"the agent failed unexpectedly ({type(exc).__name__}: {exc}); "
                                     "its log has the details — please report this"))

    async def body(request: Request, limit: int) -> bytes:
        """The request's body, refused with 413 once over ``limit`` — before a byte is read when its
        Content-Length says so."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise HTTPException(status_code=413, detail=f"request body of {declared} bytes over {limit} bytes")
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPException(status_code=413, detail=f"request body over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def json_body(request: Request, what: str) -> Any:
        try:
            return wirejson.loads(await request.body())
        except ValueError as exc:  # too deep nesting included
            raise InvalidName(f"malformed {what}: {exc}") from exc

    # who may call what is checked before any route, in one place: capsule/agent/authz.py (RULES)

    @app.get("/v1/info")
    def info() -> dict[str, Any]:
        return {"store_id": store.id, "version": capsule_version, "features": list(protocol.FEATURES)}

    @app.get("/v1/capsules")
    def capsules(request: Request) -> list[dict[str, Any]]:
        mine = authz.visible(request, store)     # an owner's: only theirs
        return [c for c in capsule_list(store) if mine is None or c["name"] in mine]

    @app.get("/v1/capsules/{name}/versions/{number}")
    def version(name: str, number: str) -> dict[str, Any]:
        return version_of(store, name, number)

    @app.post("/v1/objects/missing")
    async def objects_missing(request: Request) -> dict[str, list[str]]:
        req = await json_body(request, "request")
        if not isinstance(req, dict):
            raise InvalidName("malformed request: expected a JSON object")
        return missing(store, req.get("layers", []), req.get("files", []), authz.grant_of(request))

    @app.get("/v1/objects/{kind}/{oid}")
    async def lookup(kind: str, oid: str) -> dict[str, Any]:
        return await serve(objects.lookup, kind, oid)

    @app.get("/v1/objects/{kind}/{oid}/records")
    async def records(kind: str, oid: str, request: Request, start: RecordStartQuery = 0,
                      count: RecordCountQuery = MAX_RECORDS, hash_len: HashLenQuery = 32,
                      like: str | None = None) -> Response:
        payload, n, span = await serve(objects.records, kind, oid, start, count, hash_len, like,
                                       authz.grant_of(request))
        headers = {"X-Capsule-Records": str(n), **({LIKE_SPAN_HEADER: span} if span else {})}
        return Response(payload, media_type="application/octet-stream", headers=headers)

    @app.post("/v1/objects/{kind}/{oid}/read")
    async def read(kind: str, oid: str, request: Request, level: ZstdLevelQuery = 3, compress: bool = True) -> Response:
        indices = objects.indices(kind, oid, await body(request, 1 << 20))
        payload = await serve(objects.read, kind, oid, indices, level, compress)
        activity.served(len(indices))
        return Response(payload, media_type="application/octet-stream",
                        headers={"X-Capsule-Blocks": str(len(indices))})

    @app.websocket("/v1/objects/stream")
    async def stream(ws: WebSocket) -> None:
        """READ requests over one WebSocket. A refusal is a reply, and the connection stays usable."""
        if authz.caller_of(ws) is None:      # (the guard refused it already: this never happens)
            # a 401 like every other call (a plain close before accept would be a 403, which is also
            # what any server without this route answers: clients take that for "no stream here")
            if "websocket.http.response" in ws.scope.get("extensions", {}):
                await ws.send_denial_response(_error_reply(AuthFailed("missing or wrong bearer token")))
            else:
                await ws.close(code=1008)
            return
        await ws.accept()
        gate = authz.StreamGate(ws, store, token)      # each message's object, checked as the upgrade was
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                if msg.get("bytes") is None:
                    await ws.close(code=1003, reason="binary messages only")
                    return
                try:
                    reply = b"\x00" + await stream_read(msg["bytes"], gate)
                except Error as exc:
                    reply = encode_stream_error(str(exc), exc.code, exc.http_status)
                await ws.send_bytes(reply)
        except WebSocketDisconnect:
            return

    async def stream_read(msg: bytes, gate: authz.StreamGate) -> bytes:
        kind, oid, level, raw = decode_stream_read(msg)
        check_object_id(oid)
        await gate.admit(kind, oid)
        if objects.cached_manifest(kind, oid) is None:  # read from disk (in a thread) only the first time
            await serve(objects.manifest, kind, oid)
        indices = objects.indices(kind, oid, raw)
        activity.served(len(indices))
        if len(indices) <= 16:  # a miss's few blocks come from the page cache: a thread hop would cost more
            return objects.read(kind, oid, indices, level or 1, level > 0)
        return await serve(objects.read, kind, oid, indices, level or 1, level > 0)

    # -- receiving: state lives on disk (capsule/exchange/receiving.py), none in the protocol ----------
    @app.post("/v1/recv/{kind}/{oid}/begin")
    async def recv_begin(kind: str, oid: str, request: Request, hash: bool = True, part: PartQuery = 0,
                         parts: PartsQuery = 1, like: str | None = None, like_first: RecordStartQuery = 0,
                         like_last: RecordStartQuery = 0, like_len: HashLenQuery = PREFIX_SIZE) -> Response:
        """Part ``part`` of ``parts`` of the manifest → the indices of the blocks still needed. ``like``: a file
        held here whose records of blocks ``like_first .. like_last`` the part was compressed against."""
        raw = await body(request, MAX_MANIFEST_UPLOAD)
        dictionary = None if like is None else await serve(
            inbox.like, like, like_first, like_last, like_len, authz.grant_of(request))
        data = decode_manifest_upload(raw, dictionary)
        needed = await serve(functools.partial(inbox.begin, kind, oid, data, part=part, parts=parts, hash=hash,
                                               reader=authz.grant_of(request)))
        if needed is None:
            return Response(b"", headers={"X-Capsule-Present": "1"})
        offers = {STREAMS_HEADER: CODECS, DELTAS_HEADER: DELTA_FORMAT}
        return Response(encode_plan(needed), media_type="application/octet-stream", headers=offers)

    @app.post("/v1/recv/{kind}/{oid}/blocks")
    async def recv_blocks(kind: str, oid: str, request: Request, compress: bool = True, stream: str | None = None,
                          seq: SegmentQuery = 0, codec: str = "zstd", delta: bool = False) -> dict[str, int]:
        """A batch of blocks: a zstd frame of its own, segment ``seq`` of block stream ``stream``
        (``codec``: zstd or xz), or with ``delta`` deltas against blocks held here (hashcache/delta.py)."""
        raw = await body(request, MAX_BLOCKS_UPLOAD)
        if delta:
            kept, unresolved = await serve(inbox.accept_deltas, kind, oid, raw, authz.grant_of(request))
            return {"stored": kept, "rebuilt": kept, "unresolved": unresolved}
        if stream is None:
            return {"stored": await serve(inbox.accept_upload, kind, oid, raw, compress)}
        await turns.wait((kind, oid), stream, seq)
        try:
            return {"stored": await serve(inbox.accept_segment, kind, oid, raw, stream, seq, codec)}
        finally:
            await turns.advance()

    @app.post("/v1/recv/{kind}/{oid}/lacking")
    async def recv_lacking(kind: str, oid: str, request: Request) -> Response:
        """Which of a batch's blocks (varint indices) this receive has not kept (varint indices)."""
        raw = await body(request, MAX_LACKING_UPLOAD)
        lacking = await serve(inbox.lacking, kind, oid, raw)
        return Response(encode_indices(lacking), media_type="application/octet-stream")

    @app.post("/v1/recv/{kind}/{oid}/commit")
    async def recv_commit(kind: str, oid: str, role: str = "memory") -> dict[str, Any]:
        installed = await serve(inbox.commit, kind, oid, role)
        return {"installed": oid, "already": not installed}

    @app.post("/v1/versions")
    async def versions(request: Request) -> dict[str, Any]:
        record = await json_body(request, "version record")
        authz.check_record(request, store, record)     # a push grant: only the version it was made for
        row, created = await serve(record_version, store, record)
        return {"version": row.ref, "created": created}

    # -- running (the destination side of `capsule migrate`) ---------------------------------------
    @app.post("/v1/capsules/{name}/start")
    async def start_capsule(request: Request, name: str, version: VersionQuery | None = None,
                            timeout: TimeoutQuery = 180.0) -> dict[str, Any]:
        r = await act(request, running.start, store, name, version, timeout)
        return {"version": r.version.ref, "mode": r.mode, "domain": r.domain, "seconds": r.seconds}

    @app.post("/v1/run")
    async def run_from(request: Request) -> dict[str, Any]:
        """Start here a capsule of another host, its disks paged in on demand."""
        req = await json_body(request, "run request")
        r = await act(request, running.run_from, store, req)
        return {"version": r.start.version.ref, "mode": r.start.mode, "domain": r.start.domain,
                "seconds": r.start.seconds, "moved_bytes": r.transfer.wire_bytes, "remote_layers": r.remote_layers}

    # -- live moves (the destination side of `capsule migrate`, capsule/exchange/incoming.py) ---------------
    @app.post("/v1/live/check")
    async def live_check(request: Request) -> dict[str, Any]:
        return await act(request, incoming.check_incoming, store, await json_body(request, "live move check"))

    @app.post("/v1/live/prepare")
    async def live_prepare(request: Request) -> dict[str, Any]:
        return await act(request, incoming.prepare, store, await json_body(request, "live move request"))

    @app.post("/v1/live/{mid}/finish")
    async def live_finish(request: Request, mid: str) -> dict[str, Any]:
        return await act(request, incoming.finish, store, mid)

    @app.post("/v1/live/{mid}/abort")
    async def live_abort(request: Request, mid: str) -> dict[str, Any]:
        return await act(request, incoming.abort, store, mid)

    @app.post("/v1/live/{mid}/recover")
    async def live_recover(request: Request, mid: str) -> dict[str, Any]:
        caller = authz.caller_of(request)
        who = caller.principal.who if caller is not None else ""

        def channel(session: str) -> Path:     # the session's, if this caller opened it (NotFound, Forbidden)
            return app.state.tunnels.get(session, who).channels[tunnel.DEDUP_KIND].path

        return await act(request, incoming.recover, store, mid, channel)

    # -- fleet (capsule/exchange/fleet.py) -------------------------------------------------------------
    @app.post("/v1/fleet/pull")
    async def fleet_pull(request: Request) -> dict[str, Any]:
        """Pull NAME@V from another agent (a fleet rollout's fan-out: this host passes a version on)."""
        req = await json_body(request, "pull request")
        r = await act(request, fleet.pull_from, store, req, activity)
        return {"version": r.version, "source": r.url, "wire_bytes": r.wire_bytes, "recorded": r.recorded,
                "objects": len(r.objects), "skipped": len(r.skipped)}

    @app.post("/v1/fleet/restore")
    async def fleet_restore(request: Request) -> dict[str, Any]:
        """Restore NAME@V from a repository (a rollout --via: the repository is the source instead of the origin);
        the key and credentials in the body serve this call only and are never written."""
        req = await json_body(request, "restore request")
        r = await act(request, fleetrepo.restore_from, store, req, activity)
        return {"version": r.version, "source": r.url, "downloaded_bytes": r.downloaded_bytes,
                "recorded": r.recorded, "objects": r.objects, "objects_present": r.objects_present}

    @app.post("/v1/grants/host")
    async def grant_host(request: Request) -> dict[str, Any]:
        """A grant of this host for one job of a third host (a fleet rollout's fan-out hands the host that pulls
        a version from here a read grant for that version, never the rollout's own credential)."""
        req = await json_body(request, "grant request")
        caller = authz.caller_of(request)
        assert caller is not None
        return await serve(grants.request, store, caller.principal, req, protocol.peer_of(request))

    @app.delete("/v1/grants/self")
    async def end_grant(request: Request) -> dict[str, Any]:
        """The calling grant ends: the peer's job is done (a demand run stopped or no longer needs this host)."""
        caller = authz.caller_of(request)
        assert caller is not None
        return await serve(grants.end, store, caller.principal)

    @app.get("/v1/fleet/activity")
    def fleet_activity() -> dict[str, Any]:
        return activity.as_dict()

    @app.post("/v1/capsules/{name}/activate")
    async def activate_capsule(request: Request, name: str, version: VersionQuery, timeout: TimeoutQuery = 180.0
                               ) -> dict[str, Any]:
        return {"did": await act(request, fleet.activate, store, name, version, timeout)}

    @app.post("/v1/capsules/{name}/stop")
    async def stop_capsule(request: Request, name: str, discard: bool = False) -> dict[str, Any]:
        r = await act(request, running.stop, store, name, discard)
        return {"version": r.version.ref if r.version else None, "discarded": discard}

    # -- verify (a backup host's copies re-hashed for their source's verify job) ----------------------
    @app.post("/v1/verify")
    async def verify_here(request: Request) -> dict[str, Any]:
        req = await json_body(request, "verify request")
        refs = req.get("versions") if isinstance(req, dict) else None
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs) or len(refs) > MAX_VERIFY:
            raise InvalidName(f'malformed verify request: give {{"versions": ["NAME@V", ...]}} (at most {MAX_VERIFY})')
        report = await act(request, verify_versions, store, refs)
        users = users_of(store, refs)
        return report.as_dict() | {"used_by": {p.id: users.get(p.id, []) for p in report.problems}}

    @app.post("/v1/backups/{name}/prune")
    async def prune_copies(name: str, request: Request) -> dict[str, Any]:
        req = await json_body(request, "prune request")
        if not isinstance(req, dict) or not isinstance(req.get("policy"), dict):
            raise InvalidName('malformed prune request: give {"policy": {"daily": 30, ...}}')
        policy = Policy.from_dict(req["policy"])
        dry_run = bool(req.get("dry_run", False))
        return (await act(request, backup_runner.prune, store, name, policy=policy, dry_run=dry_run)).as_dict()

    # -- pods (the destination side of `capsule pod migrate --on HOST`, capsule/pod/remote.py) ---------------
    @app.get("/v1/pods")
    async def pods_here(request: Request, capsule: str) -> list[dict[str, Any]]:
        return await act(request, pod_ops.ls, store, capsule)

    @app.post("/v1/pods/restore")
    async def pod_restore(request: Request) -> dict[str, Any]:
        req = await json_body(request, "pod restore request")
        if not isinstance(req, dict) or not isinstance(req.get("image"), str) or not isinstance(req.get("into"), str):
            raise InvalidName('malformed pod restore request: give {"image": ID, "into": CAPSULE}')
        check_object_id(req["image"])
        return await act(request, pod_ops.restore, store, req["image"], req["into"])

    # the byte tunnel of live moves (capsule/exchange/tunnel.py): channels by kind, targets chosen here
    app.state.tunnels = tunnel.Registry(resolver=lambda objects: StoreResolver(store, objects))
    app.state.tunnels.on_end.append(lambda sid: incoming.sweep_quietly(store, sid))   # its move never finished
    incoming.sweep_quietly(store)    # moves whose streams ended with the agent that carried them
    app.include_router(tunnelapi.router(app.state.tunnels))
    dashboard.install(app, store, token)  # the page at / and its API under /api/ (capsule/agent/dashboard.py)
    authz.check_rules(app)      # every route has its rule, or no agent
    app.state.audit_log = AuditLog(home)  # the guard's writer (a bad CAPSULE_AUDIT_* setting: no agent)
    app.add_middleware(guard.Guard, fastapi=app, store=store, sessions=app.state.sessions, token=token)
    app.add_middleware(protocol.Versions)     # outermost: every answer names this agent's protocol and release
    return app
