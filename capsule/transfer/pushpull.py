"""Push and pull of capsule versions between hosts with HCP (§4.4).

Only objects the other side lacks travel (a child capsule shares its
parents' layers). Per object: the manifest first, then every block the
receiver does not already have — in its shadow from an interrupted run, or
anywhere on its disks via its hash cache — in zstd batches with many
requests in flight. Every block is verified against its hash and the object
against its digest before it is installed; the version is recorded last."""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import zstandard

from capsule.agentclient import AgentClient
from capsule.capsules import resolve
from capsule.errors import CapsuleError, TransferFailed
from capsule.exchange.streams import STREAMS_HEADER, ObjectStreamLost, offered_codecs
from capsule.names import parse_ref
from capsule.store import Store
from capsule.store.fsutil import translating_enospc
from capsule.store.objectio import BlockReader, has_object, install_received, object_manifest, object_path, open_shadow
from capsule.transfer.pacing import Pacer
from capsule.transfer.pipeline import Pipeline, run_batches
from capsule.transfer.records import objects_of, record_version, validate, version_record
from capsule.transfer.resend import send_batch, upload_body
from hashcache import native
from hashcache.blocks import BLOCK_SIZE, hash_block
from hashcache.errors import HashcacheError, ManifestMismatch
from hashcache.hcp import (
    MAX_PART_RECORDS,
    PREFIX_SIZE,
    Expectation,
    ProtocolError,
    Receiver,
    TransferStats,
    decode_indices,
    decompress_bounded,
    encode_indices,
    manifest_header,
    pack_blocks,
    records_chunks,
    unpack_blocks,
)
from hashcache.shadow import Shadow
from hashcache.transport import Transport

PART_RECORDS = MAX_PART_RECORDS   # manifest records per part when pushing


@dataclass
class Options:
    hash: bool = True          # look blocks up in the receiver's hash cache
    compress: bool = True      # zstd on the wire
    level: int = 3
    batch: int = 256           # blocks per request
    inflight: int = 8          # requests in flight
    full_hashes: bool = False  # send whole 32-byte hashes instead of 8-byte prefixes + digest check
    xz: bool = False           # blocks as one xz (LZMA2) stream per object where the receiver takes it

    @property
    def hash_len(self) -> int:
        return 32 if self.full_hashes else PREFIX_SIZE


@dataclass
class ObjectReport:
    kind: str
    id: str
    role: str
    raw_bytes: int = 0
    resumed_bytes: int = 0
    cache_bytes: int = 0
    fetched_bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0
    commit_seconds: float = 0.0      # the receiver verifying, writing and recording the object


@dataclass
class TransferReport:
    direction: str
    version: str
    url: str
    objects: list[ObjectReport] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)      # objects the receiver already had
    wire_bytes: int = 0
    seconds: float = 0.0
    recorded: bool = False

    def totals(self) -> dict[str, int]:
        keys = ("raw_bytes", "resumed_bytes", "cache_bytes", "fetched_bytes")
        return {k: sum(getattr(o, k) for o in self.objects) for k in keys}

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(self.totals())
        return d


class Progress:
    """Callbacks for a progress display: begin(total raw bytes), advance(raw bytes), wire(total wire bytes).
    A push also says which object comes next (``object``: its role and raw size, ``present`` when the
    receiver holds it already) and how many of the raw bytes it advanced by the receiver found itself
    (``local``: in its shadow or hash cache, never sent)."""

    def begin(self, label: str, total: int) -> None: ...

    def advance(self, n: int) -> None: ...

    def wire(self, total_wire: int) -> None: ...

    def object(self, kind: str, oid: str, role: str, raw_bytes: int, present: bool) -> None: ...

    def local(self, n: int) -> None: ...


Check = Callable[[], None]


def _never() -> None:
    pass


# -- pull -------------------------------------------------------------------------

def _block_hash(expect: Expectation, index: int) -> bytes:
    """A block's hash in the manifest's records (a block it has no record of: empty)."""
    return (expect.record(index) or (False, b""))[1]


def _fetch_expectation(client: AgentClient, kind: str, oid: str, hash_len: int) -> tuple[Expectation, dict]:
    """LOOKUP, then READ-HASH in chunks: what the object must turn out to be."""
    head = client.get_json(f"/v1/objects/{kind}/{oid}")
    try:  # the peer's numbers checked before any of them sizes a loop or a buffer
        count = manifest_header(head)["count"]
    except ProtocolError as exc:
        raise TransferFailed(f"{kind} {oid[:12]}: malformed LOOKUP reply from {client.url}: {exc}") from exc
    parts = []
    for start, n in records_chunks(count):
        resp = client.request("GET", f"/v1/objects/{kind}/{oid}/records",
                              params={"start": start, "count": n, "hash_len": hash_len})
        try:
            part = decompress_bounded(resp.content, n * (8 + hash_len), "records")
        except ProtocolError as exc:
            raise TransferFailed(f"{kind} {oid[:12]}: bad manifest records from the peer: {exc}") from exc
        if len(part) != n * (8 + hash_len):   # each chunk whole, or the next is never asked for
            raise TransferFailed(f"{kind} {oid[:12]}: the peer sent {len(part)} bytes of records {start}.. "
                                 f"for {n} records")
        parts.append(part)
    try:
        return Expectation.from_records(head, b"".join(parts), oid, hash_len), head
    except ProtocolError as exc:
        raise TransferFailed(f"{kind} {oid[:12]}: the peer sent an invalid manifest: {exc}") from exc


def _name_bad_block(client: AgentClient, kind: str, oid: str, shadow: Shadow, name: str) -> str:
    """After a digest mismatch with hash prefixes: fetch the full hashes, find
    the blocks that differ, forget them, and say which."""
    full, _ = _fetch_expectation(client, kind, oid, 32)
    bad = [i for i, z, h in full.records() if not z and shadow.has(i) and hash_block(shadow.read(i)) != h]
    shadow.forget(bad)
    if bad:
        return f"{name}: block {bad[0]} does not match its manifest hash ({len(bad)} bad block(s))"
    return f"{name}: the received object does not match its digest"


def _pull_object(store: Store, client: AgentClient, kind: str, oid: str, role: str, opts: Options,
                 progress: Progress) -> ObjectReport:
    t0 = time.monotonic()
    wire0 = client.wire_bytes
    expect, head = _fetch_expectation(client, kind, oid, opts.hash_len)
    if kind == "file":
        role = head.get("role", role)
    name = f"{role if kind == 'file' else 'layer'} {oid[:12]}"
    stats = TransferStats()
    shadow = open_shadow(store, kind, expect)
    try:
        receiver = Receiver(expect, shadow, name, store.hash_cache() if opts.hash else None, stats,
                            dedupe=opts.hash)
        progress.begin(name, stats.raw_bytes)
        progress.advance(len(receiver.nonzero_indices()) * BLOCK_SIZE
                         - len(shadow.missing(receiver.nonzero_indices())) * BLOCK_SIZE)
        needed = receiver.plan(on_progress=progress.advance)

        pacer = Pacer(opts.batch, opts.inflight, client.timeout)

        def fetch(batch: list[int]) -> None:
            idx = encode_indices(batch)
            with pacer.flight(len(batch)) as sent:   # a few seconds' worth of answers in flight, no more
                resp = client.request("POST", f"/v1/objects/{kind}/{oid}/read", content=idx,
                                      params={"level": opts.level, "compress": str(opts.compress).lower()},
                                      idempotent=True)
                sent.append(len(idx) + len(resp.content))
            try:
                blocks = unpack_blocks(resp.content, len(batch), compressed=opts.compress)
                with translating_enospc(f"receiving {name}"):
                    receiver.accept(batch, blocks, on_progress=progress.advance)
            except (ManifestMismatch, ProtocolError) as exc:
                raise TransferFailed(f"from {client.url}: {exc}; nothing was installed") from exc
            stats.add(requests=1)
            progress.wire(client.wire_bytes)

        run_batches(pacer.batches(needed), opts.inflight, fetch)
        if not receiver.complete():
            raise TransferFailed(f"{name}: blocks are still missing after the transfer")
        try:
            manifest = receiver.finish()
        except ManifestMismatch as exc:
            raise TransferFailed(f"from {client.url}: {_name_bad_block(client, kind, oid, shadow, name)}; "
                                 "nothing was installed") from exc
        shadow.flush()
        install_received(store, kind, manifest, shadow, role=role, hashed=True)
    finally:
        shadow.close()
    store.index_object(object_path(store, kind, oid), manifest)
    return ObjectReport(kind, oid, role, stats.raw_bytes, stats.resumed_bytes, stats.cache_bytes,
                        stats.fetched_bytes, client.wire_bytes - wire0, time.monotonic() - t0)


def _fetch_record(client: AgentClient, ref: str) -> dict[str, Any]:
    """The version record of ``NAME[@V]`` at the agent, checked (it comes from another host)."""
    r = parse_ref(ref)
    record = client.get_json(f"/v1/capsules/{r.name}/versions/{r.version or 'latest'}")
    try:
        return validate(record)
    except Exception as exc:
        raise TransferFailed(f"the agent at {client.url} sent a malformed version record: {exc}") from exc


def _pull_missing(store: Store, client: AgentClient, report: TransferReport, items: list[tuple[str, str, str]],
                  opts: Options, progress: Progress) -> None:
    """Pull each (kind, id, role) this store lacks; the rest are recorded as skipped."""
    for kind, oid, role in items:
        if has_object(store, kind, oid):
            report.skipped.append(oid)
        else:
            report.objects.append(_pull_object(store, client, kind, oid, role, opts, progress))


def _client(store: Store, url: str, token: str, fingerprint: str | None, transport: Transport | None = None,
            **kw: Any) -> AgentClient:
    """The client of the agent at ``url``, its certificate pinned to ``fingerprint`` or, without one, to the
    known host's at that URL (:func:`capsule.hosts.pin_for`)."""
    from capsule import hosts

    return AgentClient(url, token, transport=transport, fingerprint=hosts.pin_for(store, url, fingerprint), **kw)


def pull(store: Store, url: str, ref: str, token: str, opts: Options | None = None,
         progress: Progress | None = None, *, transport: Transport | None = None,
         fingerprint: str | None = None) -> TransferReport:
    """Fetch ``NAME[@V]`` from the agent at ``url`` into ``store`` (over ``transport`` if given, e.g. an
    in-process one; over https pinned to ``fingerprint`` or the known host's)."""
    opts = opts or Options()
    progress = progress or Progress()
    t0 = time.monotonic()
    with _client(store, url, token, fingerprint, transport) as client:
        record = _fetch_record(client, ref)
        report = TransferReport("pull", f"{record['capsule']}@{record['number']}", url)
        layers, files = objects_of(record)
        _pull_missing(store, client, report, [("layer", lid, "layer") for lid in layers]
                      + [("file", f, ro) for f, ro in files], opts, progress)
        _row, report.recorded = record_version(store, record)
        report.wire_bytes = client.wire_bytes
    report.seconds = time.monotonic() - t0
    return report


# -- push -------------------------------------------------------------------------

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
                 progress: Progress, check: Check = _never) -> ObjectReport | None:
    """Send one object (:func:`_send_object`); an object stream the receiver lost (it restarted) is started
    again after a new plan, which leaves out every block it kept."""
    for _ in range(STREAM_ATTEMPTS - 1):
        try:
            return _send_object(store, client, kind, oid, role, opts, progress, check)
        except ObjectStreamLost:
            continue
    return _send_object(store, client, kind, oid, role, opts, progress, check)  # a last loss is raised


StreamEncoder = native.StreamEncoder | native.XzStreamEncoder


def _stream_encoder(opts: Options, offered: set[str]) -> tuple[StreamEncoder | None, str]:
    """The object stream to send an object in, and its codec: xz where asked for and taken, else zstd at
    ``opts.level`` where the receiver takes streams (an older one names none: frames of their own)."""
    if opts.xz and "xz" in offered:
        return native.XzStreamEncoder(), "xz"
    if offered and opts.level >= STREAM_LEVEL:
        return native.StreamEncoder(opts.level), "zstd"
    return None, "zstd"


def _send_object(store: Store, client: AgentClient, kind: str, oid: str, role: str, opts: Options,
                 progress: Progress, check: Check = _never) -> ObjectReport | None:
    """Send one object: its manifest in parts (the receiver plans each part
    while the next one and the blocks it already asked for are on the wire),
    then the blocks it asks for, then commit. Where the receiver takes object streams
    (``capsule/exchange/streams.py``) and blocks travel compressed, an object's batches are segments of
    one zstd stream, compressed here in order and sent one at a time, at levels from ``STREAM_LEVEL``, or
    of one xz stream with ``opts.xz``; otherwise each batch is a zstd frame of its own (at ``opts.level``),
    packed by the thread that sends it."""
    t0 = time.monotonic()
    wire0 = client.wire_bytes
    manifest = object_manifest(store, kind, oid)
    name = f"{role} {oid[:12]}"
    raw_bytes = manifest.nonzero_blocks * BLOCK_SIZE
    progress.begin(name, raw_bytes)
    reader = BlockReader(store, kind, oid)
    stats = TransferStats(raw_bytes=raw_bytes)
    starts = list(range(0, max(1, len(manifest)), PART_RECORDS))

    streaming = opts.compress and (opts.xz or opts.level >= STREAM_LEVEL)
    inflight = 1 if streaming else opts.inflight
    pacer = Pacer(opts.batch, inflight, client.timeout)

    encoder: StreamEncoder | None = None
    stream_id = secrets.token_hex(8)
    codec = "zstd"
    segments = 0

    def send(item: tuple[list[int], int | None, bytes | None]) -> None:
        batch, seq, payload = item
        check()  # a cancel stops here; the pipeline then drops the batches still queued
        params: dict[str, Any] = {"compress": str(opts.compress).lower()}
        with pacer.flight(len(batch)) as sent:   # a few seconds' worth of bytes in flight, no more
            if payload is None:   # a frame of its own: after a lost answer, only the blocks not kept again
                sent.append(send_batch(client, kind, oid, batch, lambda b: pack_blocks(
                    reader.read(b), level=opts.level, compress=opts.compress), params))
            else:   # a segment of a stream: sent again whole (one taken twice is taken once)
                params.update(stream=stream_id, seq=seq, codec=codec)
                body = upload_body(batch, payload)
                client.request("POST", f"/v1/recv/{kind}/{oid}/blocks", content=body, params=params,
                               idempotent=True)
                sent.append(len(body))
        stats.add(fetched_bytes=len(batch) * BLOCK_SIZE, requests=1)
        progress.advance(len(batch) * BLOCK_SIZE)
        progress.wire(client.wire_bytes)

    needed_total = 0
    try:
        with Pipeline(send, inflight, max_pending=max(2, inflight)) as pipe:
            for k, start in enumerate(starts):
                part = Expectation.part_of(manifest, start, PART_RECORDS, opts.hash_len)
                resp = client.request("POST", f"/v1/recv/{kind}/{oid}/begin",
                                      content=zstandard.ZstdCompressor(level=3).compress(part.to_bytes()),
                                      params={"hash": str(opts.hash).lower(), "part": k, "parts": len(starts)},
                                      idempotent=True)   # a part sent again is taken as the same part
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
                if k == 0 and streaming:
                    encoder, codec = _stream_encoder(opts, offered_codecs(resp.headers.get(STREAMS_HEADER)))
                for batch in pacer.batches(needed):
                    if encoder is None:
                        pipe.submit((batch, None, None))
                        continue
                    pipe.submit((batch, segments, encoder.segment(b"".join(reader.read(batch)))))
                    segments += 1
    finally:
        reader.close()
    t_commit = time.monotonic()
    client.request("POST", f"/v1/recv/{kind}/{oid}/commit", params={"role": role})
    cache_bytes = raw_bytes - needed_total * BLOCK_SIZE
    return ObjectReport(kind, oid, role, raw_bytes, 0, cache_bytes, stats.fetched_bytes,
                        client.wire_bytes - wire0, time.monotonic() - t0, time.monotonic() - t_commit)


def push(store: Store, ref: str, url: str, token: str, opts: Options | None = None,
         progress: Progress | None = None, *, transport: Transport | None = None, check: Check = _never,
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
    with _client(store, url, token, fingerprint, transport) as client:
        items = [] if files_only else [("layer", lid, "layer") for lid in layers]
        items = sorted(items + [("file", f, ro) for f, ro in files], key=lambda item: item[2] != "memory")
        _push_items(store, client, report, items, opts, progress, check)
        check()
        if not files_only:
            reply = client.post_json("/v1/versions", record)
            report.recorded = bool(reply.get("created"))
        report.wire_bytes = client.wire_bytes
    report.seconds = time.monotonic() - t0
    return report


def _push_items(store: Store, client: AgentClient, report: TransferReport, items: list[tuple[str, str, str]],
                opts: Options, progress: Progress, check: Check) -> None:
    """Send each (kind, id, role) the receiver lacks, in order; the others are counted as skipped."""
    missing = client.post_json("/v1/objects/missing", {"layers": [oid for k, oid, _ in items if k == "layer"],
                                                       "files": [oid for k, oid, _ in items if k == "file"]})
    lacking = set(missing.get("layers", [])) | set(missing.get("files", []))
    for kind, oid, role in items:
        check()
        if oid not in lacking:
            progress.object(kind, oid, role, raw_size(store, kind, oid), True)
            report.skipped.append(oid)
            continue
        progress.object(kind, oid, role, raw_size(store, kind, oid), False)
        obj = _push_object(store, client, kind, oid, role, opts, progress, check)
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
    with _client(store, url, token, fingerprint, transport) as client:
        _push_items(store, client, report, [("file", fid, role) for fid, role in files], opts, progress, _never)
        report.wire_bytes = client.wire_bytes
    report.seconds = time.monotonic() - t0
    return report


# -- demand-paged run ---------------------------------------------------------------------------------

@dataclass
class RunReport:
    transfer: TransferReport
    start: Any                 # lifecycle.StartResult
    remote_layers: list[str]


def run(store: Store, url: str, ref: str, token: str, *, prefetch: bool = False, wait: bool = True,
        timeout: float = 180.0, opts: Options | None = None, progress: Progress | None = None,
        say: Callable[[str], None] = lambda _m: None, fingerprint: str | None = None) -> RunReport:
    """Start ``NAME[@V]`` of the agent at ``url`` here without copying its disks: the memory image,
    kernel and initrd come first (HCP, eagerly: §4.1 explains why memory is not demand-paged), the
    disk layers this host lacks only as manifests; their blocks are fetched as the guest reads them."""
    from capsule import lifecycle
    from capsule.lifecycle import demand

    opts = opts or Options()
    progress = progress or Progress()
    t0 = time.monotonic()
    from capsule import hosts

    pin = hosts.pin_for(store, url, fingerprint)
    with AgentClient(url, token, fingerprint=pin) as client:
        record = _fetch_record(client, ref)
        report = TransferReport("run", f"{record['capsule']}@{record['number']}", url)
        layers, files = objects_of(record)
        _pull_missing(store, client, report, [("file", f, ro) for f, ro in files], opts, progress)
        remote: list[str] = []
        for lid in layers:
            if has_object(store, "layer", lid) or demand.is_remote(store, lid):
                if demand.is_remote(store, lid) and demand.remote_info(store, lid)["url"] == url:
                    demand.token_file_for(store, url, token)   # a new run's token (an earlier one may have ended)
                report.skipped.append(lid)
                continue
            say(f"manifest of layer {lid[:12]}")
            expect, _head = _fetch_expectation(client, "layer", lid, 32)
            try:
                manifest = expect.manifest_from(functools.partial(_block_hash, expect))
            except ManifestMismatch as exc:
                raise TransferFailed(f"from {url}: {exc}") from exc
            demand.add_remote_layer(store, manifest, url, token, pin)
            remote.append(lid)
        _row, report.recorded = record_version(store, record)
        report.wire_bytes = client.wire_bytes
    report.seconds = time.monotonic() - t0
    started = lifecycle.start(store, report.version, prefetch=prefetch, wait=wait, timeout=timeout, say=say)
    return RunReport(report, started, remote)
