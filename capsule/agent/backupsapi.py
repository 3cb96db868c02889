"""The dashboard's backups: the schedules with their last results, each capsule's backups, a run now, a
restore, and the host's verify job — each the library call ``capsule backup …`` makes.

    GET  /api/backups                      schedules (with their backups) and the verify job
    POST /api/backups/{name}/run           back NAME up now (then prune and copy, as a scheduled run)
    POST /api/backups/{name}/restore       {version, as_name}: start a backup as a new capsule, or as NAME's latest
    POST /api/backups/verify               re-hash what the backups reference, here and on the backup hosts

Sessions and CSRF as for every ``/api`` call (:mod:`capsule.agent.sessions`). Mounted by
:func:`capsule.agent.dashboard.install`, before the API's catch-all."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from capsule.agent import authz
from capsule.agent.bounded import Version
from capsule.agent.sessions import Sessions
from capsule.agent.workers import workers_of
from capsule.backup import jobs, runner, verifyjob
from capsule.errors import Conflict
from capsule.names import check_name
from capsule.store import Store


class RestoreIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Version = Field(description="The backup's version number (NAME@V)")
    as_name: str | None = Field(default=None, max_length=64,
                                description="Start it as a new capsule of this name; without it the backup "
                                            "becomes NAME's latest version (NAME must not be running)")


class BackupOut(BaseModel):
    ref: str
    version: int
    created: float
    note: str


class JobOut(BaseModel):
    capsule: str
    calendar: str
    normalized: str
    policy_text: str
    mode: str
    target: str | None
    target_policy_text: str | None
    next_run: float | None
    running_since: float | None
    last_run: float | None
    last_result: str | None
    last_duration: float | None
    last_bytes: int | None
    last_pause: float | None
    last_version: int | None
    last_error: str | None
    backups: list[BackupOut]


class VerifyJobOut(BaseModel):
    calendar: str
    next_run: float | None
    last_run: float | None
    last_result: str | None
    last_error: str | None


class BackupsOut(BaseModel):
    jobs: list[JobOut]
    verify: VerifyJobOut | None


def overview(store: Store) -> dict[str, Any]:
    """What the panel shows: every schedule with its backups (newest first), and the verify job."""
    out = []
    for job in jobs.jobs(store):
        backups = [{"ref": v.ref, "version": v.number, "created": v.created, "note": v.note}
                   for v in reversed(jobs.backups(store, job.capsule))]
        out.append(job.as_dict() | {"backups": backups})
    check = verifyjob.get(store)
    return {"jobs": out, "verify": check.as_dict() if check else None}


def router(store: Store, sessions: Sessions) -> APIRouter:
    def caller(request: Request, response: Response) -> None:
        response.headers["Cache-Control"] = "no-store"
        sessions.authenticate(request)

    r = APIRouter(prefix="/api", tags=["backups"], dependencies=[Depends(caller)])

    @r.get("/backups", response_model=BackupsOut, summary="Backup schedules, their backups and the verify job")
    async def backups(request: Request) -> dict[str, Any]:
        out = await asyncio.to_thread(overview, store)
        mine = authz.visible(request, store)
        return out if mine is None else out | {"jobs": [j for j in out["jobs"] if j["capsule"] in mine]}

    @r.post("/backups/verify", summary="Re-hash what the backups reference, here and on the backup hosts")
    async def verify(request: Request) -> dict[str, Any]:
        """As the verify job does (its result is recorded on the job, if there is one)."""
        result = await workers_of(request).act(request, verifyjob.run_job, store)
        if result is None:
            raise Conflict("a verify of the backups is running already: wait for its result")
        return result.as_dict()

    @r.post("/backups/{name}/run", summary="Back a capsule up now (then prune, then copy)")
    async def run(name: str, request: Request) -> dict[str, Any]:
        return (await workers_of(request).act(request, runner.run, store, check_name(name))).as_dict()

    @r.post("/backups/{name}/restore", summary="Start a backup, as a new capsule or as the capsule's latest")
    async def restore(name: str, body: RestoreIn, request: Request) -> dict[str, Any]:
        as_name = check_name(body.as_name) if body.as_name is not None else None   # "" is refused, never "latest"
        done = await workers_of(request).act(request, runner.restore, store, f"{check_name(name)}@{body.version}",
                                             as_name=as_name)
        if as_name is not None:
            authz.adopt(request, store, as_name)      # a new capsule: the caller's
        return done.as_dict()

    return r
