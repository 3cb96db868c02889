"""Migrations started from the dashboard: ``capsule.migrate.migrate`` (the call ``capsule migrate`` makes) in a
thread of the agent, its progress kept and streamed, and a cancel.

    GET  /api/capsules/{name}/migrate/check?to=HOST   why a live move there would be refused (empty: it may go)
    POST /api/capsules/{name}/migrate      {to: a known host's name, max_pause, postcopy: live (the default); or
                                            mode: full|demand, balloon (or live: false): offline} → the migration
                                            (live: true with a mode or balloon: 400, naming the conflict)
    GET  /api/migrations                   the migrations this agent ran since it started (newest first)
    GET  /api/migrations/{id}              one of them: its last progress snapshot, and how it ended
    GET  /api/migrations/{id}/events       Server-Sent Events: each progress snapshot (``data:`` JSON), until the end
    POST /api/migrations/{id}/cancel       stop it; the capsule runs here again (409 once the other host is starting it)

The destination is always a known peer (``capsule host add``): its URL and token come from this host's peers
table, never from the request. In demand mode the other host reads the disks from this agent at its public URL
(``capsule serve --public-url``, by default what it listens on), never at one made from the request (its Host
or X-Forwarded-* headers are the caller's to choose). Sessions and CSRF as for every
``/api`` call (:mod:`capsule.agent.sessions`). Mounted by :func:`capsule.agent.dashboard.install`."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from capsule import hosts
from capsule import migrate as lib
from capsule.accounts import grants
from capsule.agent import authz
from capsule.agent.sessions import Caller, Sessions
from capsule.agent.workers import Ticket, workers_of
from capsule.errors import Conflict, Error, Internal, NotFound
from capsule.migrate.choice import choose
from capsule.migrate.progress import CancelToken, Snapshot, planned
from capsule.names import check_name
from capsule.store import Store

KEEP = 50                 # finished migrations remembered
KEEPALIVE = 15.0          # seconds between comments on an idle event stream
HISTORY = 5000            # snapshots kept per migration (a stream replays them; ~10 a second at most)


class MigrateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: str = Field(description="A known host's name (`capsule host ls`)", min_length=1, max_length=64)
    live: bool | None = Field(None, description="Move it while it runs (the default unless mode or balloon is "
                                                "named); false: suspend it here first, as `--offline`")
    max_pause: float = Field(1.0, ge=0.01, le=60, allow_inf_nan=False,
                             description="Live: the longest the guest may pause at the switchover, in seconds")
    postcopy: bool = Field(False, description="Live: allow post-copy when pre-copy does not converge (a link that "
                                              "breaks during post-copy is waited for, 120 s; if it does not return "
                                              "the guest boots here from its disks as they were at the switchover)")
    mode: Literal["full", "demand"] | None = Field(None, description="An offline move's mode (naming it makes the "
                                                                     "move offline; full when offline and none)")
    balloon: bool = Field(False, description="Balloon before suspending (makes the move offline)")

    def chosen(self) -> MigrateIn:
        """This request with its kind decided (:mod:`capsule.migrate.choice`): ``live`` and ``mode`` set."""
        kind = choose(self.live, self.mode, self.balloon, self.postcopy)
        return self.model_copy(update={"live": kind.live, "mode": None if kind.live else kind.mode})
    balloon_policy: Literal["none", "cache", "aggressive"] = "cache"
    balloon_method: Literal["agent", "virtio"] = "virtio"


class MigrationOut(BaseModel):
    id: str
    capsule: str
    to: str = Field(description="The destination host's name")
    to_url: str = Field(description="Its agent (and dashboard) URL")
    mode: str
    balloon: bool
    started: float
    progress: dict[str, Any] = Field(description="The last snapshot: phases, phase, bytes, ETA, outcome, where")
    error: dict[str, Any] | None = Field(None, description="How it failed or was cancelled (the error body)")
    remote: dict[str, Any] | None = Field(None, description="The other host's answer to the start")


class Migration:
    """One migration run by this agent: its cancel token, its snapshots, and who waits for the next one."""

    def __init__(self, name: str, peer: hosts.Peer, body: MigrateIn, ticket: Ticket | None = None) -> None:
        self.id = secrets.token_hex(8)
        body = body.chosen()
        self.capsule, self.peer, self.body = name, peer, body
        self.ticket = ticket        # its owner's count of operations under way, given back when it ends
        self.started = time.time()
        self.cancel = CancelToken()
        self.error: dict[str, Any] | None = None
        self.remote: dict[str, Any] | None = None
        self.last = Snapshot(0, name, peer.name, planned("live", body.postcopy) if body.live
                             else planned(body.mode or "full", body.balloon), "")
        self._history: deque[Snapshot] = deque([self.last], maxlen=HISTORY)
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def finished(self) -> bool:
        return self.last.outcome is not None

    def publish(self, snap: Snapshot) -> None:
        with self._lock:
            self.last = snap
            self._history.append(snap)
            waiters = list(self._waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def _after(self, seq: int) -> Snapshot | None:
        if self.last.seq <= seq:
            return None
        return next((s for s in self._history if s.seq > seq), self.last)

    async def next_after(self, seq: int, timeout: float) -> Snapshot | None:
        """The first snapshot after ``seq`` still kept (so a listener sees every phase), or None after
        ``timeout`` seconds without one."""
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        with self._lock:
            if (snap := self._after(seq)) is not None:
                return snap
            self._waiters.add(waiter)
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return None
        finally:
            with self._lock:
                self._waiters.discard(waiter)
        with self._lock:
            return self._after(seq)

    def out(self) -> MigrationOut:
        return MigrationOut(id=self.id, capsule=self.capsule, to=self.peer.name, to_url=self.peer.url,
                            mode="live" if self.body.live else self.body.mode or "full", balloon=self.body.balloon,
                            started=self.started,
                            progress=self.last.as_dict(), error=self.error, remote=self.remote)

    def run(self, store: Store, source_url: str, source_token: str, source_fingerprint: str | None = None) -> None:
        try:
            self._run(store, source_url, source_token, source_fingerprint)
        finally:
            if self.ticket is not None:
                self.ticket.release()

    def _run(self, store: Store, source_url: str, source_token: str, source_fingerprint: str | None) -> None:
        b = self.body
        final: list[Snapshot] = []

        def on_event(s: Snapshot) -> None:  # the end goes out once its error or answer is known
            if s.outcome is None:
                self.publish(s)
            else:
                final.append(s)

        try:
            r = lib.migrate(store, self.capsule, self.peer.url, self.peer.token, mode=b.mode or "full",
                            balloon=b.balloon_policy if b.balloon else None, balloon_method=b.balloon_method,
                            source_url=source_url, source_token=source_token, on_event=on_event,
                            cancel=self.cancel, to_name=self.peer.name, source_fingerprint=source_fingerprint,
                            live=bool(b.live), max_pause=b.max_pause, postcopy=b.postcopy)
            self.remote = r.remote
        except Error as exc:
            self.error = exc.to_wire()
            if b.mode == "demand" and not b.live and getattr(exc, "restored", True):   # the other host does not run it
                grants.discard(store, source_token)
        except Exception as exc:  # noqa: BLE001 - a bug must still end the migration the page is watching
            self.error = Internal(f"{type(exc).__name__}: {exc}").to_wire()
        if final:
            self.publish(final[-1])
        else:  # refused before it began (e.g. the capsule stopped meanwhile)
            cancelled = bool(self.error and self.error.get("error") == lib.MigrationCancelled.code)
            self.publish(replace(self.last, seq=self.last.seq + 1, outcome="cancelled" if cancelled else "failed",
                                 where="source", message=str((self.error or {}).get("detail", "")),
                                 cancellable=False))


class Migrations:
    """The migrations of one agent, in memory (newest last)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, Migration] = OrderedDict()

    def get(self, mid: str) -> Migration:
        with self._lock:
            m = self._by_id.get(mid)
        if m is None:
            raise NotFound(f"no migration {mid[:32]!r} on this host (they are kept until the agent restarts)")
        return m

    def all(self) -> list[Migration]:
        with self._lock:
            return list(reversed(self._by_id.values()))

    def begin(self, store: Store, name: str, body: MigrateIn, source_url: str, source_token: str,
              source_fingerprint: str | None = None, ticket: Ticket | None = None) -> Migration:
        """Start migrating ``name`` in a thread of its own; ``ticket`` (its caller's admission, see
        ``workers.py``) is released when the migration ends."""
        peer = hosts.get(store, body.to)
        check_name(name)
        if store.catalogue.capsule(name) is None:
            raise NotFound(f"no capsule named {name!r} on this host")
        if store.catalogue.instance(name) is None:
            raise Conflict(f"capsule {name!r} is not running: only a running capsule migrates")
        m = Migration(name, peer, body, ticket)
        with self._lock:
            if any(o.capsule == name and not o.finished for o in self._by_id.values()):
                raise Conflict(f"capsule {name!r} is already being migrated")
            self._by_id[m.id] = m
            finished = [k for k, o in self._by_id.items() if o.finished]
            for k in finished[:max(0, len(self._by_id) - KEEP)]:
                del self._by_id[k]
        threading.Thread(target=m.run, args=(store, source_url, source_token, source_fingerprint),
                         name=f"migrate-{m.id}", daemon=True).start()
        return m


def source_url_for(request: Request) -> str:
    """This agent's URL as the other host should reach it (demand mode): its configured public URL."""
    url = getattr(request.app.state, "public_url", None)
    if not url:
        raise Conflict("this agent does not know the URL other hosts reach it at (it listens on every address): "
                       "start `capsule serve` with --public-url https://HOST:PORT for demand migrations; "
                       "nothing was changed")
    return hosts.check_url(url)


def router(store: Store, sessions: Sessions, token: str, migrations: Migrations | None = None) -> APIRouter:
    def caller(request: Request, response: Response) -> Caller:
        response.headers["Cache-Control"] = "no-store"
        return sessions.authenticate(request)

    migrations = migrations or Migrations()
    r = APIRouter(prefix="/api", tags=["migrations"], dependencies=[Depends(caller)])

    @r.post("/capsules/{name}/migrate", response_model=MigrationOut, status_code=202,
            summary="Move a running capsule to a known host")
    def start(name: str, body: MigrateIn, request: Request) -> MigrationOut:
        body = body.chosen()      # a 400 naming the conflict before anything
        demand = body.mode == "demand" and not body.live
        source = source_url_for(request) if demand else ""
        # the other host pins this agent's certificate (the one it serves with, --cert included)
        pin = getattr(request.app.state, "tls_fingerprint", None)
        grant = token
        if demand:
            # what the other host pages the disks in with: the old token, or (once accounts exist) a read grant
            # for this capsule, made by the signed-in user who started the migration (it ends with that user or
            # token)
            caller = authz.caller_of(request)
            assert caller is not None
            issuer, issuer_token = grants.issuer_of(caller.principal)
            grant = grants.for_demand_run(store, token, name, issuer, issuer_token)
        ticket = workers_of(request).quota.admit(request)   # counted against its owner until it ends
        try:
            return migrations.begin(store, name, body, source, grant, pin, ticket).out()
        except BaseException:
            ticket.release()        # (it never began; once begun, its thread releases it)
            if grant is not token:
                grants.discard(store, grant)
            raise

    @r.get("/capsules/{name}/migrate/check", summary="Why a live move to a known host would be refused")
    def check(name: str, to: str) -> dict[str, Any]:
        from capsule.migrate import precheck

        check_name(name)
        peer = hosts.get(store, to)
        refusals = precheck.precheck(store, name, precheck.Target(peer.url, peer.token, peer.fingerprint))
        return {"capsule": name, "to": peer.name, "refusals": [x.as_dict() for x in refusals]}

    @r.get("/migrations", response_model=list[MigrationOut], summary="This agent's migrations, newest first")
    def list_all(request: Request) -> list[MigrationOut]:
        mine = authz.visible(request, store)
        return [m.out() for m in migrations.all() if mine is None or m.capsule in mine]

    @r.get("/migrations/{mid}", response_model=MigrationOut, summary="One migration and its progress")
    def one(mid: str) -> MigrationOut:
        return migrations.get(mid).out()

    @r.get("/migrations/{mid}/events", summary="Its progress as Server-Sent Events, until it ends",
           response_class=StreamingResponse)
    def events(mid: str) -> StreamingResponse:
        m = migrations.get(mid)

        async def stream() -> AsyncIterator[str]:
            seq = -1
            while True:
                snap = await m.next_after(seq, KEEPALIVE)
                if snap is None:
                    yield ": still running\n\n"
                    continue
                seq = snap.seq
                body = m.out().model_dump() | {"progress": snap.as_dict()}
                yield f"id: {snap.seq}\nevent: progress\ndata: {json.dumps(body)}\n\n"
                if snap.outcome is not None:
                    yield "event: end\ndata: {}\n\n"
                    return

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    @r.post("/migrations/{mid}/cancel", response_model=MigrationOut, summary="Cancel: the capsule runs here again")
    def cancel(mid: str) -> MigrationOut:
        m = migrations.get(mid)
        if m.finished:
            raise Conflict(f"the migration of {m.capsule} has already ended ({m.last.outcome})")
        if not m.cancel.cancel():
            raise Conflict(f"too late to cancel: {m.peer.name} is starting {m.capsule}")
        return m.out()

    return r
