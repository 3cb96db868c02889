"""The host agent's HTTP API (FastAPI). Every request carries a bearer token;
the agent only ever serves objects of its own store, named by validated ids.

HCP calls (stateless, §4.4.3)::

    GET  /v1/objects/{kind}/{id}                 LOOKUP: manifest header (+ role of a file object)
    GET  /v1/objects/{kind}/{id}/records         READ-HASH: ?start=&count= raw records, zstd
    POST /v1/objects/{kind}/{id}/read            READ: body = varint block indices → zstd blocks
    WS   /v1/objects/stream                      READ, many per connection (demand paging's misses;
                                                 wire format in hashcache/hcp.py)

Receiving (push) — state lives in the object's shadow on disk, not in memory::

    POST /v1/recv/{kind}/{id}/begin              body = zstd(manifest) → zstd(varint indices still needed)
    POST /v1/recv/{kind}/{id}/blocks             body = u32 n, n bytes of varint indices, zstd blocks
    POST /v1/recv/{kind}/{id}/commit             verify the digest, install, record

Management::

    GET  /v1/info, GET /v1/capsules, GET /v1/capsules/{name}/versions/{n|latest}
    POST /v1/objects/missing                     {"layers": [...], "files": [...]} → what this store lacks
    POST /v1/versions                            record a version whose objects have all arrived
"""

from __future__ import annotations

import asyncio
import hmac
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import zstandard
from fastapi import Depends, FastAPI, HTTPException, Request, Response, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capsule import __version__ as capsule_version
from capsule.agent.records import record_version, version_record
from capsule.capsules import resolve
from capsule.errors import AuthFailed, Conflict, Error, Internal, InvalidName, NotFound
from capsule.names import check_name, check_object_id
from capsule.objectio import (
    ReaderCache,
    check_kind,
    has_object,
    install_received,
    object_manifest,
    object_path,
    open_shadow,
)
from capsule.store import Store
from hashcache.atomic import write_atomic
from hashcache.errors import ManifestMismatch, error_class
from hashcache.hcp import (
    MAX_BATCH,
    PREFIX_SIZE,
    Expectation,
    ProtocolError,
    Receiver,
    compact_records,
    decode_indices,
    decode_stream_read,
    encode_indices,
    encode_stream_error,
    header_of,
    pack_blocks,
    unpack_blocks,
)
from hashcache.manifest import Manifest
from hashcache.shadow import Shadow

MAX_MANIFEST_UPLOAD = 512 << 20
MAX_BLOCKS_UPLOAD = MAX_BATCH * 4096 + (1 << 20)
MAX_RECORDS = 1 << 20


def _error_reply(exc: Error, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one mapping from an error to an answer: its class's status; ``{"error": code, "detail":
    message, ...fields}`` (see :mod:`hashcache.errors`)."""
    return JSONResponse(exc.to_wire(), status_code=exc.http_status, headers=headers)


def create_app(home: Path, token: str) -> FastAPI:
    if not token or len(token) < 16:
        raise InvalidName("the agent's token must be at least 16 characters")
    app = FastAPI(title="Capsule host agent", version=capsule_version, docs_url=None, redoc_url=None)
    store = Store.open(home)
    readers = ReaderCache(store)
    manifests: OrderedDict[tuple[str, str], Manifest] = OrderedDict()
    manifests_lock = threading.Lock()

    def cached_manifest(kind: str, oid: str) -> Manifest | None:
        key = (kind, oid)
        with manifests_lock:
            m = manifests.get(key)
            if m is not None:
                manifests.move_to_end(key)
            return m

    def manifest_of(kind: str, oid: str) -> Manifest:
        """Sealed objects never change: their manifests are read (and checked) once."""
        m = cached_manifest(kind, oid)
        if m is not None:
            return m
        m = object_manifest(store, kind, oid)
        with manifests_lock:
            manifests[(kind, oid)] = m
            while len(manifests) > 64:
                manifests.popitem(last=False)
        return m
    expected = f"Bearer {token}".encode()

    def auth(request: Request) -> None:
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            raise AuthFailed("missing or wrong bearer token")

    # One mapping from errors to answers: {"error": code, "detail": message, ...fields}, the class's status.
    @app.exception_handler(Error)
    async def _errors(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Error)
        return _error_reply(exc, {"WWW-Authenticate": "Bearer"} if isinstance(exc, AuthFailed) else None)

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
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPException(status_code=413, detail=f"request body over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    deps = [Depends(auth)]

    @app.get("/v1/info", dependencies=deps)
    def info() -> dict[str, Any]:
        return {"store_id": store.id, "version": capsule_version}

    @app.get("/v1/capsules", dependencies=deps)
    def capsules() -> list[dict[str, Any]]:
        out = []
        for cap in store.catalogue.capsules():
            out.append({"name": cap.name, "uuid": cap.uuid,
                        "versions": [v.number for v in store.catalogue.versions(cap.name)]})
        return out

    @app.get("/v1/capsules/{name}/versions/{number}", dependencies=deps)
    def version(name: str, number: str) -> dict[str, Any]:
        check_name(name)
        ref = name if number == "latest" else f"{name}@{number}"
        return version_record(store, resolve(store, ref))

    @app.post("/v1/objects/missing", dependencies=deps)
    async def missing(request: Request) -> dict[str, list[str]]:
        try:
            req = await request.json()
            layers = [check_object_id(x) for x in req.get("layers", [])]
            files = [check_object_id(x) for x in req.get("files", [])]
        except (ValueError, AttributeError, TypeError) as exc:
            raise InvalidName(f"malformed request: {exc}") from exc
        return {"layers": [x for x in layers if not has_object(store, "layer", x)],
                "files": [x for x in files if not has_object(store, "file", x)]}

    @app.get("/v1/objects/{kind}/{oid}", dependencies=deps)
    def lookup(kind: str, oid: str) -> dict[str, Any]:
        m = manifest_of(kind, oid)
        head = header_of(m)
        if kind == "file":
            row = store.catalogue.file(oid)
            head["role"] = row.role if row else "memory"
        return head

    @app.get("/v1/objects/{kind}/{oid}/records", dependencies=deps)
    def records(kind: str, oid: str, start: int = 0, count: int = MAX_RECORDS, hash_len: int = 32) -> Response:
        m = manifest_of(kind, oid)
        if start < 0 or count < 0 or count > MAX_RECORDS or hash_len not in (PREFIX_SIZE, 32):
            raise InvalidName(f"bad record range start={start} count={count} hash_len={hash_len}")
        n = min(count, max(0, len(m) - start))
        raw = compact_records(m, start, n, hash_len)
        return Response(zstandard.ZstdCompressor(level=3).compress(raw), media_type="application/octet-stream",
                        headers={"X-Capsule-Records": str(n)})

    @app.post("/v1/objects/{kind}/{oid}/read", dependencies=deps)
    async def read(kind: str, oid: str, request: Request, level: int = 3, compress: bool = True) -> Response:
        m = manifest_of(kind, oid)
        indices = decode_indices(await body(request, 1 << 20), m.block_count)
        if not 1 <= level <= 19:
            raise InvalidName("zstd level must be 1..19")

        def work() -> bytes:
            blocks = readers.get(kind, oid).read(indices)
            return pack_blocks(blocks, level=level, compress=compress)

        payload = await asyncio.to_thread(work)
        return Response(payload, media_type="application/octet-stream",
                        headers={"X-Capsule-Blocks": str(len(indices))})

    @app.websocket("/v1/objects/stream")
    async def stream(ws: WebSocket) -> None:
        """READ requests over one WebSocket. A refusal is a reply, and the connection stays usable."""
        if not hmac.compare_digest(ws.headers.get("authorization", "").encode(), expected):
            # a 401 like every other call (a plain close before accept would be a 403, which is also
            # what any server without this route answers: clients take that for "no stream here")
            if "websocket.http.response" in ws.scope.get("extensions", {}):
                await ws.send_denial_response(_error_reply(AuthFailed("missing or wrong bearer token")))
            else:
                await ws.close(code=1008)
            return
        await ws.accept()
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                if msg.get("bytes") is None:
                    await ws.close(code=1003, reason="binary messages only")
                    return
                try:
                    reply = b"\x00" + await stream_read(msg["bytes"])
                except Error as exc:
                    reply = encode_stream_error(str(exc), exc.code, exc.http_status)
                await ws.send_bytes(reply)
        except WebSocketDisconnect:
            return

    async def stream_read(msg: bytes) -> bytes:
        kind, oid, level, raw = decode_stream_read(msg)
        check_object_id(oid)
        m = cached_manifest(kind, oid)  # read from disk (in a thread) only the first time
        if m is None:
            m = await asyncio.to_thread(manifest_of, kind, oid)
        indices = decode_indices(raw, m.block_count)

        def work() -> bytes:
            return pack_blocks(readers.get(kind, oid).read(indices), level=level or 1, compress=level > 0)

        # a miss's few blocks come from the page cache in microseconds: a thread hop would cost more
        return work() if len(indices) <= 16 else await asyncio.to_thread(work)

    # -- receiving ------------------------------------------------------------
    # Open receivers are a cache (rebuilt from the shadow and manifest on disk
    # whenever missing), so the protocol itself keeps no per-client state.
    receivers: OrderedDict[tuple[str, str], tuple[Shadow, Receiver, tuple[bool, int]]] = OrderedDict()
    receivers_lock = threading.Lock()
    # Manifest parts become one whole manifest file while blocks requests read them:
    # both sides hold this lock, so a reader never meets a part that was just folded away.
    manifest_files_lock = threading.Lock()

    def drop_receiver(kind: str, oid: str) -> None:
        with receivers_lock:
            entry = receivers.pop((kind, oid), None)
        if entry:
            entry[0].close()

    def manifest_state(kind: str, oid: str) -> tuple[bool, int]:
        """What of the manifest is on disk: whole, or how many parts (a part may land at any time)."""
        with manifest_files_lock:
            return expect_path(kind, oid).exists(), len(part_paths(kind, oid))

    def get_receiver(kind: str, oid: str) -> Receiver:
        """The cached receiver of an object, brought up to date with the manifest parts on disk (a
        block of a part can arrive right after that part was planned)."""
        state = manifest_state(kind, oid)
        with receivers_lock:
            entry = receivers.get((kind, oid))
            if entry:
                receivers.move_to_end((kind, oid))
        if entry:
            shadow, receiver, seen = entry
            if seen != state:
                receiver.update(recv_manifest(kind, oid))
                with receivers_lock:
                    if (kind, oid) in receivers:
                        receivers[(kind, oid)] = (shadow, receiver, state)
            return receiver
        m = recv_manifest(kind, oid)
        shadow = open_shadow(store, kind, m)
        receiver = Receiver(m, shadow, f"{kind} {oid[:12]}")
        with receivers_lock:
            raced = (kind, oid) in receivers
            if not raced:
                receivers[(kind, oid)] = (shadow, receiver, state)
                while len(receivers) > 8:
                    _, (old, _r, _s) = receivers.popitem(last=False)
                    old.close()
        if raced:  # another request cached one first: use that (outside the lock)
            shadow.close()
            return get_receiver(kind, oid)
        return receiver

    def expect_path(kind: str, oid: str) -> Path:
        return store.home / "recv" / f"{check_kind(kind)}-{check_object_id(oid)}.expect"

    def part_paths(kind: str, oid: str) -> list[Path]:
        base = expect_path(kind, oid)
        return sorted(base.parent.glob(base.stem + ".part*"), key=lambda p: int(p.suffix[5:]))

    def recv_manifest(kind: str, oid: str) -> Expectation:
        """The whole manifest once every part has arrived; before that, the parts so far."""
        path = expect_path(kind, oid)
        with manifest_files_lock:
            if path.exists():
                return Expectation.from_bytes(path.read_bytes(), oid)
            parts = part_paths(kind, oid)
            if not parts:
                raise NotFound(f"no transfer of {kind} {oid[:12]} has begun here")
            raw = [p.read_bytes() for p in parts]
        return Expectation.concat([Expectation.from_bytes(r, oid) for r in raw])

    @app.post("/v1/recv/{kind}/{oid}/begin", dependencies=deps)
    async def recv_begin(kind: str, oid: str, request: Request, hash: bool = True, part: int = 0,
                         parts: int = 1) -> Response:
        """Part ``part`` of ``parts`` of the manifest (sent in pieces so that planning one part
        overlaps the upload of the next and of the blocks already asked for)."""
        check_kind(kind)
        check_object_id(oid)
        if not 0 <= part < parts <= 4096:
            raise InvalidName(f"bad manifest part {part} of {parts}")
        raw = await body(request, MAX_MANIFEST_UPLOAD)
        try:
            data = zstandard.ZstdDecompressor().decompress(raw, max_output_size=MAX_MANIFEST_UPLOAD)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"bad zstd manifest: {exc}") from exc
        m = Expectation.from_bytes(data, oid)
        if m.header["kind"] != kind:
            raise ProtocolError(f"{kind} {oid[:12]}: the uploaded manifest is of a {m.header['kind']}")
        parent = m.header.get("parent")
        if has_object(store, kind, oid):
            return Response(b"", headers={"X-Capsule-Present": "1"})
        if kind == "layer" and parent and not has_object(store, "layer", parent):
            raise Conflict(f"layer {oid[:12]} needs its parent {parent[:12]} first")

        if part == 0:
            drop_receiver(kind, oid)

        def work() -> bytes:
            (store.home / "recv").mkdir(exist_ok=True)
            final = expect_path(kind, oid)
            with manifest_files_lock:
                if part == 0:  # a new transfer (the shadow, with its verified blocks, stays)
                    final.unlink(missing_ok=True)
                    for p in part_paths(kind, oid):
                        p.unlink()
                elif len(part_paths(kind, oid)) != part:
                    raise Conflict(f"{kind} {oid[:12]}: manifest part {part} arrived before the parts before it")
                target = final if parts == 1 else final.with_suffix(f".part{part}")
                write_atomic(target, data, durable=False)
                if parts > 1 and part == parts - 1:
                    whole = Expectation.concat([Expectation.from_bytes(p.read_bytes(), oid)
                                                for p in part_paths(kind, oid)])
                    write_atomic(final, whole.to_bytes(), durable=False)
                    for p in part_paths(kind, oid):
                        p.unlink()
            with open_shadow(store, kind, m) as shadow:
                cache = store.hash_cache() if hash else None
                needed = Receiver(m, shadow, f"{kind} {oid[:12]}", cache, dedupe=hash).plan()
            return zstandard.ZstdCompressor(level=3).compress(encode_indices(needed))

        return Response(await asyncio.to_thread(work), media_type="application/octet-stream")

    @app.post("/v1/recv/{kind}/{oid}/blocks", dependencies=deps)
    async def recv_blocks(kind: str, oid: str, request: Request, compress: bool = True) -> dict[str, int]:
        receiver = await asyncio.to_thread(get_receiver, kind, oid)
        m = receiver.manifest
        raw = await body(request, MAX_BLOCKS_UPLOAD)
        if len(raw) < 4:
            raise ProtocolError("truncated block upload")
        (n,) = struct.unpack_from("<I", raw)
        if n > len(raw) - 4:
            raise ProtocolError("truncated block upload")
        indices = decode_indices(raw[4:4 + n], m.block_count)

        def work() -> None:
            blocks = unpack_blocks(raw[4 + n:], len(indices), compressed=compress)
            receiver.accept(indices, blocks)

        await asyncio.to_thread(work)
        return {"stored": len(indices)}

    @app.post("/v1/recv/{kind}/{oid}/commit", dependencies=deps)
    async def recv_commit(kind: str, oid: str, role: str = "memory") -> dict[str, Any]:
        if has_object(store, kind, oid):
            return {"installed": oid, "already": True}
        if not expect_path(kind, oid).exists():
            raise Conflict(f"{kind} {oid[:12]}: not every part of its manifest has arrived")
        m = recv_manifest(kind, oid)
        drop_receiver(kind, oid)

        def work() -> None:
            shadow = open_shadow(store, kind, m)
            try:
                receiver = Receiver(m, shadow, f"{kind} {oid[:12]}")
                if not receiver.complete():
                    raise Conflict(f"{kind} {oid[:12]} is not complete yet")
                try:
                    manifest = receiver.finish()
                except ManifestMismatch:
                    shadow.remove()  # the sender's data was wrong somewhere: start over
                    expect_path(kind, oid).unlink(missing_ok=True)
                    raise
                install_received(store, kind, manifest, shadow, role=role)
            finally:
                shadow.close()
            store.index_object(object_path(store, kind, oid), manifest)
            expect_path(kind, oid).unlink(missing_ok=True)

        await asyncio.to_thread(work)
        return {"installed": oid, "already": False}

    @app.post("/v1/versions", dependencies=deps)
    async def versions(request: Request) -> dict[str, Any]:
        try:
            record = await request.json()
        except ValueError as exc:
            raise InvalidName(f"malformed version record: {exc}") from exc
        row, created = await asyncio.to_thread(record_version, store, record)
        return {"version": row.ref, "created": created}

    # -- running (the destination side of `capsule migrate`) ---------------------------------------
    @app.post("/v1/capsules/{name}/start", dependencies=deps)
    async def start_capsule(name: str, version: int | None = None, timeout: float = 180.0) -> dict[str, Any]:
        from capsule import lifecycle

        check_name(name)
        ref = name if version is None else f"{name}@{version}"
        r = await asyncio.to_thread(lifecycle.start, store, ref, timeout=min(max(timeout, 1.0), 900.0))
        return {"version": r.version.ref, "mode": r.mode, "domain": r.domain, "seconds": r.seconds}

    @app.post("/v1/run", dependencies=deps)
    async def run_from(request: Request) -> dict[str, Any]:
        """Start here a capsule of another host, its disks paged in on demand."""
        from capsule import transfer

        try:
            req = await request.json()
            source, token, ref = req["source"], req["token"], req["ref"]
            prefetch = bool(req.get("prefetch", False))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidName(f"malformed run request: {exc}") from exc
        if not isinstance(source, str) or not source.startswith(("http://", "https://")) or not isinstance(token, str):
            raise InvalidName("run needs a source agent URL and its token")
        r = await asyncio.to_thread(transfer.run, store, source, str(ref), token, prefetch=prefetch)
        return {"version": r.start.version.ref, "mode": r.start.mode, "domain": r.start.domain,
                "seconds": r.start.seconds, "moved_bytes": r.transfer.wire_bytes, "remote_layers": r.remote_layers}

    return app
