"""Push of capsule versions (and of sealed files of no version) to another host with HCP (§4.4).

Only objects the other side lacks travel (a child capsule shares its
parents' layers). Per object: the manifest first, then every block the
receiver does not already have — in its shadow from an interrupted run, or
anywhere on its disks via its hash cache — in batches with many
requests in flight. Every block is verified against its hash and the object
against its digest before it is installed; the version is recorded last."""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from typing import Any
from weakref import WeakKeyDictionary

from capsule.agentclient import AgentClient
from capsule.capsules import resolve
from capsule.errors import CapsuleError, TransferFailed
from capsule.exchange.streams import STREAMS_HEADER, ObjectStreamLost, offered_codecs
from capsule.store import Store
from capsule.store.objectio import BlockReader, object_manifest
from capsule.transfer import codecpick, deltapick, deltasend
from capsule.transfer.codecpick import NONE, Codec, CodecPicker
from capsule.transfer.deltapick import DeltaPick
from capsule.transfer.manifestparts import PartSender, like_candidates
from capsule.transfer.pacing import Pacer
from capsule.transfer.pipeline import Pipeline
from capsule.transfer.records import objects_of, version_record
from capsule.transfer.resend import send_batch, upload_body
from capsule.transfer.similar import Similar
from capsule.transfer.terms import Check, ObjectReport, Options, Progress, TransferReport, agent_client, never
from hashcache import native
from hashcache.blocks import BLOCK_SIZE
from hashcache.delta import DELTAS_HEADER
from hashcache.errors import HashcacheError
from hashcache.hcp import (
    MAX_PART_RECORDS,
    Expectation,
    ProtocolError,
    decode_indices,
    decompress_bounded,
    pack_blocks,
)
from hashcache.transport import Transport

PART_RECORDS = MAX_PART_RECORDS   # manifest records per part when pushing


def raw_size(store: Store, kind: str, oid: str) -> int:
    """The bytes of an object's non-zero blocks (what HCP accounts for), 0 if this store cannot tell."""
    try:
        return object_manifest(store, kind, oid).nonzero_blocks * BLOCK_SIZE
    except (OSError, CapsuleError, HashcacheError):
        return 0


STREAM_ATTEMPTS = 3  # object streams started for one object before a lost one fails the push
# from this zstd level on (asking for bytes over speed), an object's batches are one stream, sent one at a
# time: the receiver takes segments in order, so uploads in flight together would only wait for each other
STREAM_LEVEL = 10


def _push_object(store: Store, client: AgentClient, kind: str, oid: str, role: str, opts: Options,
                 progress: Progress, check: Check = never, like: str | None = None) -> ObjectReport | None:
    """Send one object (:func:`_send_object`); an object stream the receiver lost (it restarted) is started
    again after a new plan, which leaves out every block it kept."""
    for _ in range(STREAM_ATTEMPTS - 1):
        try:
            return _send_object(store, client, kind, oid, role, opts, progress, check, like)
        except ObjectStreamLost:
            continue
    return _send_object(store, client, kind, oid, role, opts, progress, check, like)  # a last loss is raised


StreamEncoder = native.StreamEncoder | native.XzStreamEncoder


def _stream_encoder(codec: Codec, allowed: list[Codec]) -> StreamEncoder | None:
    """The object stream to send an object's next batches in: ``codec``'s where it is a stream codec (xz,
    zstd from ``STREAM_LEVEL``) the receiver takes, else None (frames of their own)."""
    if not codec.is_stream(STREAM_LEVEL) or codec not in allowed:
        return None
    return native.XzStreamEncoder() if codec.name == "xz" else native.StreamEncoder(codec.level)


def _sample(reader: BlockReader, batch: list[int]) -> bytes:
    """A probe's sample of a batch: its first blocks."""
    return b"".join(reader.read(batch[:codecpick.PROBE_BLOCKS]))


def _tail(reader: BlockReader, batch: list[int]) -> bytes:
    """The end of a batch: what a stream would have seen just before the next one."""
    return b"".join(reader.read(batch[-codecpick.PROBE_BLOCKS:]))


def _pack(reader: BlockReader, picker: CodecPicker, codec: Codec, sample: float | None, batch: list[int]) -> bytes:
    """A batch's blocks as a frame of their own in ``codec``; the time it took counts for the codec's rate
    (``sample``: zstd -3's ratio on a probe of the batch)."""
    blocks = reader.read(batch)
    c0 = time.perf_counter()
    payload = pack_blocks(blocks, level=codec.level or 1, compress=codec != NONE)
    picker.record(codec, len(batch) * BLOCK_SIZE, len(payload), time.perf_counter() - c0, sample)
    return payload


_PICKERS: WeakKeyDictionary[AgentClient, CodecPicker] = WeakKeyDictionary()
_DELTA_PICKS: WeakKeyDictionary[CodecPicker, DeltaPick] = WeakKeyDictionary()


def _picker(client: AgentClient, opts: Options) -> CodecPicker:
    """The codec picker of the transfer ``client`` carries: one for all its objects, so what the link and
    the data showed for one object counts for the next."""
    picker = _PICKERS.get(client)
    if picker is None:
        picker = _PICKERS[client] = opts.picker(STREAM_LEVEL)
    return picker


def _delta_pick(picker: CodecPicker) -> DeltaPick:
    """Whether deltas pay in the transfer of ``picker`` (``deltapick.py``): one for all its objects."""
    pick = _DELTA_PICKS.get(picker)
    if pick is None:
        pick = _DELTA_PICKS[picker] = DeltaPick(picker)
    return pick


def _send_object(store: Store, client: AgentClient, kind: str, oid: str, role: str, opts: Options,
                 progress: Progress, check: Check = never, like: str | None = None) -> ObjectReport | None:
    """Send one object: its manifest in parts (the receiver plans each part
    while the next one and the blocks it already asked for are on the wire),
    then the blocks it asks for, then commit. Each batch's codec is the transfer's picker's
    (``codecpick.py``: by the link's measured rate, or the one given): frames of their own (none, zstd -3),
    packed by the thread that sends them, many in flight; or, while the picker names a stream codec the
    receiver takes (``capsule/exchange/streams.py``: zstd from ``STREAM_LEVEL``, xz), segments of one object
    stream, compressed here in order and sent one at a time. When the pick changes, the stream's segments
    in flight are waited for and the next batches go in frames or in a new stream. A layer whose parent
    the receiver holds sends the blocks it asks for a slice at a time, those that pay as deltas first
    (``deltasend.py``: where ``deltapick.py`` finds they arrive sooner, or a stream codec was given). ``like``:
    a file the receiver holds that the manifest parts are compressed against (``manifestparts.py``)."""
    t0 = time.monotonic()
    wire0 = client.wire_bytes
    manifest = object_manifest(store, kind, oid)
    name = f"{role} {oid[:12]}"
    raw_bytes = manifest.nonzero_blocks * BLOCK_SIZE
    progress.begin(name, raw_bytes)
    reader = BlockReader(store, kind, oid)
    stats = deltasend.DeltaStats(raw_bytes=raw_bytes)
    starts = list(range(0, max(1, len(manifest)), PART_RECORDS))

    picker = _picker(client, opts)
    pacer = Pacer(opts.batch, opts.inflight, client.timeout, meter=picker.meter)
    allowed: list[Codec] = []
    used: dict[str, int] = {}

    encoder: StreamEncoder | None = None
    stream_id = secrets.token_hex(8)
    stream_codec = NONE
    segments = 0

    def send(item: tuple[list[int], int | None, bytes | None, Codec, str, float | None]) -> None:
        batch, seq, payload, codec, sid, sample = item
        check()  # a cancel stops here; the pipeline then drops the batches still queued
        params: dict[str, Any] = {"compress": str(codec != NONE).lower()}
        with pacer.flight(len(batch)) as sent:   # a few seconds' worth of bytes in flight, no more
            if payload is None:   # a frame of its own: after a lost answer, only the blocks not kept again
                pack = functools.partial(_pack, reader, picker, codec, sample)
                sent.append(send_batch(client, kind, oid, batch, pack, params))
            else:   # a segment of a stream: sent again whole (one taken twice is taken once)
                params.update(stream=sid, seq=seq, codec=codec.name)
                body = upload_body(batch, payload)
                client.request("POST", f"/v1/recv/{kind}/{oid}/blocks", content=body, params=params,
                               idempotent=True)
                sent.append(len(body))
        stats.add(fetched_bytes=len(batch) * BLOCK_SIZE, requests=1)
        progress.advance(len(batch) * BLOCK_SIZE)
        progress.wire(client.wire_bytes)

    needed_total = 0
    parts = PartSender(store, client, kind, oid, opts.hash_len, lookup=opts.hash, like=like)
    previous: list[int] = []
    similar: Similar | None = None
    try:
        with Pipeline(send, opts.inflight, max_pending=max(2, opts.inflight)) as frames, \
                Pipeline(send, 1, max_pending=2) as stream:
            for k, start in enumerate(starts):
                part = Expectation.part_of(manifest, start, PART_RECORDS, opts.hash_len)
                resp = parts.begin(part, k, len(starts))
                if resp.headers.get("X-Capsule-Present"):
                    if k == 0:
                        progress.advance(raw_bytes)
                        progress.local(raw_bytes)
                    return None
                try:
                    raw = decompress_bounded(resp.content, manifest.block_count * 10 + 64, "plan")
                    needed = decode_indices(raw, manifest.block_count, max_count=manifest.block_count)
                except ProtocolError as exc:
                    raise TransferFailed(f"{name}: the receiver's plan is malformed: {exc}") from exc
                part_bytes = sum(1 for _i, z, _h in part.records() if not z) * BLOCK_SIZE
                progress.advance(part_bytes - len(needed) * BLOCK_SIZE)
                progress.local(part_bytes - len(needed) * BLOCK_SIZE)
                needed_total += len(needed)
                if k == 0:
                    allowed = codecpick.candidates(offered_codecs(resp.headers.get(STREAMS_HEADER)), STREAM_LEVEL)
                    similar = deltasend.similar(store, kind, manifest.parent, oid, opts,
                                                resp.headers.get(DELTAS_HEADER), picker)
                step = deltapick.SLICE_BLOCKS if picker.forced is None else max(1, len(needed))
                slices = deltasend.ahead(similar, _delta_pick(picker), lambda: picker.current or codecpick.ZSTD3,
                                         [needed[at:at + step] for at in range(0, len(needed), step)], reader)
                with contextlib.closing(slices):
                    for chunk, deltas in slices:
                        if deltas:
                            chunk = deltasend.upload(client, pacer, (kind, oid), chunk, deltas, stats, progress, check)
                        for batch in pacer.batches(chunk):
                            for pipe in (frames, stream):
                                if pipe.failed:
                                    pipe.close()   # raises its first error
                            sample = picker.probe(allowed, functools.partial(_sample, reader, batch),
                                                  functools.partial(_tail, reader, previous) if previous else None)
                            previous = batch
                            pick = picker.choose(allowed, keep=stream_codec if encoder is not None else None)
                            if encoder is None or pick != stream_codec:   # frames, or a stream no longer the pick
                                if encoder is not None:   # its segments in flight first: a new stream replaces it there
                                    stream.drain()
                                    stream_id, segments = secrets.token_hex(8), 0
                                stream_codec, encoder = pick, _stream_encoder(pick, allowed)
                                pacer.inflight = 1 if encoder is not None else opts.inflight
                            used_codec = stream_codec
                            used[used_codec.label] = used.get(used_codec.label, 0) + len(batch) * BLOCK_SIZE
                            if encoder is None:
                                frames.submit((batch, None, None, used_codec, "", sample))
                                continue
                            data = b"".join(reader.read(batch))
                            c0 = time.perf_counter()
                            segment = encoder.segment(data)
                            seconds = time.perf_counter() - c0
                            if sample is None and segments:     # its history shows against its own batch
                                sample = picker.yardstick(data)
                            picker.record(used_codec, len(data), len(segment), seconds, sample, first=segments == 0)
                            stream.submit((batch, segments, segment, used_codec, stream_id, None))
                            segments += 1
    finally:
        reader.close()
        if similar is not None:
            similar.close()
    t_commit = time.monotonic()
    client.request("POST", f"/v1/recv/{kind}/{oid}/commit", params={"role": role})
    cache_bytes = raw_bytes - needed_total * BLOCK_SIZE
    report = ObjectReport(kind, oid, role, raw_bytes, 0, cache_bytes, stats.fetched_bytes, client.wire_bytes - wire0,
                          time.monotonic() - t0, time.monotonic() - t_commit).used(picker, used)
    report.delta_blocks, report.delta_bytes = stats.delta_blocks, stats.delta_bytes
    report.like = parts.like_id if parts.liked else None
    if similar is not None:
        report.deltas = "given" if picker.forced is not None else _delta_pick(picker).decision or "unmeasured"
        report.delta_figures = dict(_delta_pick(picker).figures) if picker.forced is None else {}
    return report


def push(store: Store, ref: str, url: str, token: str, opts: Options | None = None,
         progress: Progress | None = None, *, transport: Transport | None = None, check: Check = never,
         files_only: bool = False, fingerprint: str | None = None) -> TransferReport:
    """Send ``NAME[@V]`` from ``store`` to the agent at ``url`` (over ``transport`` if given). The memory
    image goes first (a restore needs it first). ``check`` is called before each object and each batch
    and stops the push by raising (a cancel). ``files_only``: send the memory image, kernel and initrd
    but neither the disk layers nor the version record (demand paging brings the rest)."""
    opts = opts or Options()
    progress = progress or Progress()
    t0 = time.monotonic()
    version = resolve(store, ref)
    record = version_record(store, version)
    report = TransferReport("push", version.ref, url)
    layers, files = objects_of(record)
    likes = {version.memory: like_candidates(store, version.capsule, version.number, version.memory)
             } if version.memory and opts.like else {}
    with agent_client(store, url, token, fingerprint, transport) as client:
        items = [] if files_only else [("layer", lid, "layer") for lid in layers]
        items = sorted(items + [("file", f, ro) for f, ro in files], key=lambda item: item[2] != "memory")
        _push_items(store, client, report, items, opts, progress, check, likes)
        check()
        if not files_only:
            reply = client.post_json("/v1/versions", record)
            report.recorded = bool(reply.get("created"))
        report.wire_bytes = client.wire_bytes
    report.seconds = time.monotonic() - t0
    return report


def _push_items(store: Store, client: AgentClient, report: TransferReport, items: list[tuple[str, str, str]],
                opts: Options, progress: Progress, check: Check, likes: dict[str, list[str]] | None = None) -> None:
    """Send each (kind, id, role) the receiver lacks, in order; the others are counted as skipped. ``likes``:
    per file, files whose manifest resembles its own, the best first: the first the receiver holds is its
    like (``manifestparts.py``)."""
    likes = likes or {}
    asked = [oid for k, oid, _ in items if k == "file"]
    asked += [c for cands in likes.values() for c in cands if c not in asked]
    missing = client.post_json("/v1/objects/missing", {"layers": [oid for k, oid, _ in items if k == "layer"],
                                                       "files": asked})
    lacking = set(missing.get("layers", [])) | set(missing.get("files", []))
    held = {oid: next((c for c in cands if c not in lacking), None) for oid, cands in likes.items()}
    for kind, oid, role in items:
        check()
        if oid not in lacking:
            progress.object(kind, oid, role, raw_size(store, kind, oid), True)
            report.skipped.append(oid)
            continue
        progress.object(kind, oid, role, raw_size(store, kind, oid), False)
        obj = _push_object(store, client, kind, oid, role, opts, progress, check, held.get(oid))
        if obj is None:
            report.skipped.append(oid)
        else:
            report.objects.append(obj)


def push_files(store: Store, files: list[tuple[str, str]], url: str, token: str, opts: Options | None = None,
               progress: Progress | None = None, *, fingerprint: str | None = None,
               transport: Transport | None = None) -> TransferReport:
    """Send sealed file objects, given as (id, role), that belong to no version (a pod image): with HCP like
    every object, so the blocks the receiver holds already stay home. Nothing is recorded but the files."""
    opts = opts or Options()
    progress = progress or Progress()
    t0 = time.monotonic()
    report = TransferReport("push", ", ".join(f"{role} {fid[:12]}" for fid, role in files), url)
    with agent_client(store, url, token, fingerprint, transport) as client:
        _push_items(store, client, report, [("file", fid, role) for fid, role in files], opts, progress, never)
        report.wire_bytes = client.wire_bytes
    report.seconds = time.monotonic() - t0
    return report
