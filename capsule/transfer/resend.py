"""Uploading one batch of a push's blocks, and sending again after a lost answer only what the receiver lacks.

An upload that got no answer (the receiving agent was killed and started again, the link broke or stalled)
may have been kept whole, in part or not at all: the receiver keeps each verified block of a batch as it
arrives. Rather than send the whole batch again, as a plain retry of an idempotent call would, the sender asks
the receiver which of the batch's blocks it lacks (``POST /v1/recv/{kind}/{id}/lacking``, itself retried while
the receiver restarts) and uploads only those. A push interrupted by a lost answer therefore sends again no
block the receiver holds. A receiver without that call (an older release) gets the whole batch again."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

from capsule.agentclient import AgentClient
from capsule.errors import NotFound, TransferFailed, Unreachable
from hashcache.hcp import ProtocolError, decode_indices, encode_indices

Pack = Callable[[list[int]], bytes]   # a batch's blocks as they travel (a zstd frame, or raw)


def upload_body(batch: list[int], payload: bytes) -> bytes:
    """A block upload as it travels: u32 n, n bytes of varint indices, the packed blocks."""
    idx = encode_indices(batch)
    return struct.pack("<I", len(idx)) + idx + payload


def lacking(client: AgentClient, kind: str, oid: str, batch: list[int]) -> list[int]:
    """Which of ``batch``'s blocks the receiver has not kept (all of them if it cannot say)."""
    try:
        reply = client.request("POST", f"/v1/recv/{kind}/{oid}/lacking", content=encode_indices(batch),
                               idempotent=True)
    except NotFound:
        return batch   # a receiver from before this call (or one that lost the transfer: the upload says so)
    try:
        still = decode_indices(reply.content, batch[-1] + 1 if batch else 0, max_count=len(batch))
    except ProtocolError as exc:
        raise TransferFailed(f"{kind} {oid[:12]}: the receiver's list of blocks it lacks is malformed: {exc}") from exc
    if not set(still) <= set(batch):
        raise TransferFailed(f"{kind} {oid[:12]}: the receiver says it lacks blocks that were not in the batch")
    return still


def send_batch(client: AgentClient, kind: str, oid: str, batch: list[int], pack: Pack, params: dict[str, Any],
               sleep: Callable[[float], None] = time.sleep) -> int:
    """Upload ``batch`` (its blocks packed by ``pack``); after an upload that got no answer, pause as the
    client's retry policy says, ask which blocks the receiver lacks and upload only those, until one is
    answered or the policy's pauses run out (:class:`Unreachable`). A refused connection fails at once, as
    for any call. Returns the bytes of every upload sent."""
    pauses = client.retry_pauses()
    todo, sent = batch, 0
    while True:
        body = upload_body(todo, pack(todo))
        try:
            client.request("POST", f"/v1/recv/{kind}/{oid}/blocks", content=body, params=params, idempotent=False)
            return sent + len(body)
        except Unreachable as exc:
            sent += len(body)
            pause = next(pauses, None)
            if exc.refused or pause is None:
                raise
        sleep(pause)
        todo = lacking(client, kind, oid, batch)
        if not todo:
            return sent
