"""A push's blocks as deltas (``similar.py``, format in ``hashcache/delta.py``): which of a slice of the
blocks the receiver lacks go as deltas (``deltapick.py``: picked by the link, or every one that pays where a
stream codec was given), made a slice ahead in a thread of their own while the push sends (:func:`ahead`),
and their uploads, paced and measured with the push's whole blocks (``pacing.py``: a delta upload's bytes
and time count for the link's rate, as the codec picker needs)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from capsule.agentclient import AgentClient
from capsule.errors import TransferFailed
from capsule.store import Store
from capsule.store.objectio import BlockReader
from capsule.transfer import deltapick
from capsule.transfer.codecpick import Codec, CodecPicker
from capsule.transfer.deltapick import DeltaPick
from capsule.transfer.pacing import Pacer
from capsule.transfer.resend import lacking, upload_body
from capsule.transfer.similar import Similar
from capsule.transfer.terms import Check, Options, Progress
from hashcache import delta
from hashcache.blocks import BLOCK_SIZE
from hashcache.delta import Delta
from hashcache.hcp import MAX_BATCH, TransferStats

DELTA_UPLOAD_BYTES = 4 << 20      # delta records in one upload, at most (the receiver takes 5 MiB)


@dataclass
class DeltaStats(TransferStats):
    """A push's byte counts, and its blocks sent as deltas (``similar.py``) and their bytes."""

    delta_blocks: int = 0
    delta_bytes: int = 0


def similar(store: Store, kind: str, parent: str | None, oid: str, opts: Options, offered: str | None,
            picker: CodecPicker) -> Similar | None:
    """Deltas for this object's blocks (``similar.py``): a layer whose parent the receiver holds (it takes
    no layer before its parent), a receiver that decodes them (``DELTAS_HEADER``), blocks compressed, and
    no codec given that asks for speed (a codec given keeps deltas only if it is a stream codec)."""
    if kind != "layer" or parent is None or not opts.deltas or opts.codec == "none" or not delta.offered(offered):
        return None
    given = picker.forced
    if given is not None and not given.is_stream(picker.stream_level):
        return None
    return Similar(store, oid, parent)


def split(sim: Similar, pick: DeltaPick, codec: Codec, needed: list[int], reader: BlockReader,
          remaining: int = 0) -> tuple[list[int], list[Delta]]:
    """A slice of ``needed`` blocks (ascending) as (indices to send whole, deltas of the others): every
    block tried at zstd -19 where a stream codec was given, else as ``pick`` plans (whole ones going in
    ``codec``), each part's search and encoding timed for it (and, on a trial or probe, the receiver's
    rebuilding); ``remaining``: the object's blocks still to send, this slice's included."""
    if pick.picker.forced is not None:   # a stream codec given (``similar``): bytes over speed
        sim.level = delta.DELTA_LEVEL
        return sim.split(needed, reader)
    plan = pick.next_slice(codec, max(remaining, len(needed)) * BLOCK_SIZE, sim.opened)
    if plan.mode == deltapick.NONE or not needed:
        return needed, []
    cut = deltapick.TRIAL_BLOCKS
    parts = [(needed[:cut], plan.probe, True), (needed[cut:], plan.level, False)] if plan.probe else \
        [(needed, plan.level, False)] if plan.mode == deltapick.ALL else [(needed[:cut], plan.level, True)]
    whole: list[int] = []
    deltas: list[Delta] = []
    for part, level, timed in parts:
        if part:
            w, d = _measured(sim, pick, part, reader, level, timed)
            whole += w
            deltas += d
    tried = sum(len(p) for p, _lv, _t in parts)
    return sorted(whole + needed[tried:]), deltas


def _measured(sim: Similar, pick: DeltaPick, part: list[int], reader: BlockReader, level: int,
              timed: bool) -> tuple[list[int], list[Delta]]:
    """``sim.split`` of ``part`` at ``level``, measured for ``pick`` (``timed``: the rebuilding too)."""
    blocks0, bytes0, decode0 = sim.delta_blocks, sim.delta_bytes, sim.decode_seconds
    sim.timing, sim.level = timed, level
    open0 = sim.open_seconds
    c0 = time.thread_time()   # CPU seconds of this thread: the pick's cost, whatever else runs meanwhile
    try:
        whole, deltas = sim.split(part, reader)
    finally:
        sim.timing = False
    seconds = time.thread_time() - c0
    if sim.open_seconds != open0:   # reading the file systems (debugfs, apart): once an object
        pick.opened(sim.open_seconds)
    decode = sim.decode_seconds - decode0
    pick.record(len(part) * BLOCK_SIZE, (sim.delta_blocks - blocks0) * BLOCK_SIZE, sim.delta_bytes - bytes0,
                seconds - decode, decode if timed else None, level)
    return whole, deltas


def ahead(sim: Similar | None, pick: DeltaPick, codec: Callable[[], Codec], slices: list[list[int]],
          reader: BlockReader) -> Generator[tuple[list[int], list[Delta]], None, None]:
    """Each slice of an object's needed blocks as (blocks to send whole, deltas): :func:`split`, in a thread
    of its own one slice ahead, so that making the next slice's deltas overlaps sending this one's (the
    pick's model: CPU and link at once). ``codec()``: the whole blocks' codec now. Without ``sim``, every
    block whole. Close it (``contextlib.closing``) before closing ``sim``: that waits for the slice in work."""
    if sim is None:
        yield from ((s, []) for s in slices)
        return
    left = [sum(len(s) for s in slices[k:]) for k in range(len(slices))]
    with ThreadPoolExecutor(1, thread_name_prefix="deltas") as pool:
        job: Future[tuple[list[int], list[Delta]]] | None = None
        for k, part in enumerate(slices):
            if job is None:
                job = pool.submit(split, sim, pick, codec(), part, reader, left[k])
            result = job.result()
            job = pool.submit(split, sim, pick, codec(), slices[k + 1], reader, left[k + 1]) \
                if k + 1 < len(slices) else None
            yield result


def upload(client: AgentClient, pacer: Pacer, obj: tuple[str, str], whole: list[int], deltas: list[Delta],
           stats: DeltaStats, progress: Progress, check: Check) -> list[int]:
    """Upload ``deltas`` (:func:`_upload`); returns the blocks to send whole: ``whole``, and those the
    receiver could not rebuild."""
    return sorted(whole + _upload(client, pacer, obj, deltas, stats, progress, check))


def _uploads(deltas: list[Delta]) -> list[list[Delta]]:
    """Deltas grouped into uploads the receiver takes: at most ``MAX_BATCH`` blocks, ``MAX_UPLOAD_REFS``
    references and ``DELTA_UPLOAD_BYTES`` of records each."""
    out: list[list[Delta]] = []
    blocks = refs = size = 0
    for d in deltas:
        if not out or blocks + len(d.indices) > MAX_BATCH or refs + d.ref_count > delta.MAX_UPLOAD_REFS \
                or size + d.wire_size > DELTA_UPLOAD_BYTES:
            out.append([])
            blocks = refs = size = 0
        out[-1].append(d)
        blocks, refs, size = blocks + len(d.indices), refs + d.ref_count, size + d.wire_size
    return out


def _upload(client: AgentClient, pacer: Pacer, obj: tuple[str, str], deltas: list[Delta], stats: DeltaStats,
            progress: Progress, check: Check) -> list[int]:
    """Upload blocks as deltas, each upload within the push's window (its bytes and time measure the link);
    returns those the receiver did not rebuild (references it could not read), to send whole."""
    kind, oid = obj
    again: list[int] = []
    for part in _uploads(deltas):
        check()
        batch = sorted(i for d in part for i in d.indices)
        body = upload_body(batch, delta.pack(part))
        with pacer.flight(len(batch)) as sent:
            reply = client.request("POST", f"/v1/recv/{kind}/{oid}/blocks", content=body, params={"delta": "true"},
                                   idempotent=True).json()
            sent.append(len(body))
        rebuilt = reply.get("rebuilt") if isinstance(reply, dict) else None
        if not isinstance(rebuilt, int) or isinstance(rebuilt, bool) or not 0 <= rebuilt <= len(batch):
            raise TransferFailed(f"{kind} {oid[:12]}: the receiver's answer to a delta upload is malformed")
        todo = lacking(client, kind, oid, batch) if rebuilt < len(batch) else []
        gone = set(todo)
        kept = [d for d in part if not gone.intersection(d.indices)]
        n = sum(len(d.indices) for d in kept)
        stats.add(fetched_bytes=n * BLOCK_SIZE, requests=1, delta_blocks=n, delta_bytes=sum(d.wire_size for d in kept))
        progress.advance(n * BLOCK_SIZE)
        progress.wire(client.wire_bytes)
        again.extend(todo)
    return again
