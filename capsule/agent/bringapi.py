"""Bring a peer's capsule here (the dashboard's "Bring here"): one library call each (:mod:`capsule.migrate.bring`).

    GET  /api/hosts/{host}/capsules/{name}/bring/check    may it come here: {to, refused, live_refusals}
    POST /api/hosts/{host}/capsules/{name}/bring          {live, max_pause, postcopy, mode, balloon} (as a migrate,
                                                          without ``to``: it is this host) → the peer's migration
    GET  /api/hosts/{host}/migrations/{mid}               that migration, asked of the peer
    GET  /api/hosts/{host}/migrations/{mid}/events        its progress (Server-Sent Events), relayed from the peer
    POST /api/hosts/{host}/migrations/{mid}/cancel        cancel it: the capsule runs on the peer again

This agent calls the peer with its own token for the peer (the peers table's, as the console relay does), so
only this host's operators and admins may (authz.py); the peer's rules then decide what that token may do there.
Mounted by :func:`capsule.agent.dashboard.install`, before the ``/api`` catch-all."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field

from capsule.agent.migrations import MigrateIn, MigrationOut
from capsule.agent.sessions import Caller, Sessions
from capsule.migrate import bring as lib
from capsule.store import Store


class BringIn(MigrateIn):
    """A migrate's fields but the destination (this host)."""
    model_config = ConfigDict(extra="forbid")
    to: str = Field("", max_length=0, description="(not given: the destination is this host)")


class BringOut(MigrationOut):
    host: str = Field(description="The peer the capsule comes from, whose migration this is")


def router(store: Store, sessions: Sessions) -> APIRouter:
    def caller(request: Request, response: Response) -> Caller:
        response.headers["Cache-Control"] = "no-store"
        return sessions.authenticate(request)

    r = APIRouter(prefix="/api/hosts", tags=["migrations"], dependencies=[Depends(caller)])

    @r.get("/{host}/capsules/{name}/bring/check", summary="Whether a peer's capsule may be brought here")
    async def check(host: str, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(lib.check, store, host, name)

    @r.post("/{host}/capsules/{name}/bring", response_model=BringOut, status_code=202,
            summary="Have a peer migrate its capsule here")
    async def bring(host: str, name: str, body: BringIn) -> dict[str, Any]:
        wanted = body.chosen().model_dump(exclude={"to"})      # a 400 naming the conflict before anything
        return await asyncio.to_thread(lib.bring, store, host, name, wanted)

    @r.get("/{host}/migrations/{mid}", response_model=BringOut, summary="A peer's migration and its progress")
    async def one(host: str, mid: str) -> dict[str, Any]:
        return await asyncio.to_thread(lib.migration, store, host, mid)

    @r.get("/{host}/migrations/{mid}/events", response_class=StreamingResponse,
           summary="A peer's migration's progress as Server-Sent Events, relayed until it ends")
    async def events(host: str, mid: str) -> StreamingResponse:
        stream = await lib.events(store, host, mid)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    @r.post("/{host}/migrations/{mid}/cancel", response_model=BringOut,
            summary="Cancel a peer's migration: the capsule runs there again")
    async def cancel(host: str, mid: str) -> dict[str, Any]:
        return await asyncio.to_thread(lib.cancel, store, host, mid)

    return r
