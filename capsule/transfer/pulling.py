"""Pull of capsule versions from another host with HCP (§4.4), and a demand-paged run of one.

Only objects this store lacks travel. Per object: LOOKUP and READ-HASH (what it must turn out to be), then
the receiver plans from its shadow of an interrupted run and its hash cache, and READs the rest in batches
with many requests in flight. Every block is verified against its hash and the object against its digest
before it is installed; the version is recorded last."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capsule.agentclient import AgentClient
from capsule.errors import TransferFailed
from capsule.names import parse_ref
from capsule.store import Store
from capsule.store.fsutil import translating_enospc
from capsule.store.objectio import has_object, install_received, object_manifest, object_path, open_shadow
from capsule.transfer import codecpick
from capsule.transfer.codecpick import NONE, CodecPicker
from capsule.transfer.manifestparts import held_like, span_dictionary
from capsule.transfer.pacing import Pacer
from capsule.transfer.pipeline import run_batches
from capsule.transfer.records import objects_of, record_version, validate
from capsule.transfer.terms import ObjectReport, Options, Progress, TransferReport, agent_client
from hashcache.blocks import BLOCK_SIZE, hash_block
from hashcache.errors import ManifestMismatch
from hashcache.hcp import (
    LIKE_SPAN_HEADER,
    Expectation,
    ProtocolError,
    Receiver,
    TransferStats,
    decompress_bounded,
    encode_indices,
    manifest_header,
    records_chunks,
    unpack_blocks,
)
from hashcache.manifest import Manifest
from hashcache.shadow import Shadow
from hashcache.transport import Transport


def _block_hash(expect: Expectation, index: int) -> bytes:
    """A block's hash in the manifest's records (a block it has no record of: empty)."""
    return (expect.record(index) or (False, b""))[1]


def _fetch_expectation(client: AgentClient, kind: str, oid: str, hash_len: int,
                       like: tuple[str, Manifest] | None = None) -> tuple[Expectation, dict]:
    """LOOKUP, then READ-HASH in chunks: what the object must turn out to be (against ``like``, a file this store
    holds, where the peer holds it too: ``manifestparts.py``)."""
    head = client.get_json(f"/v1/objects/{kind}/{oid}")
    try:  # the peer's numbers checked before any of them sizes a loop or a buffer
        header = manifest_header(head)
        count, blocks = header["count"], -(-header["size"] // BLOCK_SIZE)
    except ProtocolError as exc:
        raise TransferFailed(f"{kind} {oid[:12]}: malformed LOOKUP reply from {client.url}: {exc}") from exc
    parts = []
    for start, n in records_chunks(count):
        params: dict[str, Any] = {"start": start, "count": n, "hash_len": hash_len}
        if like is not None:
            params["like"] = like[0]
        resp = client.request("GET", f"/v1/objects/{kind}/{oid}/records", params=params)
        try:
            against = span_dictionary(like[1], resp.headers.get(LIKE_SPAN_HEADER), hash_len, blocks) \
                if like is not None else None
            part = decompress_bounded(resp.content, n * (8 + hash_len), "records", dictionary=against)
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


STREAM_LEVEL_PULL = 20   # a pull's READ answers are frames at any level: never an object stream
PULL_CODECS = codecpick.candidates((), STREAM_LEVEL_PULL, streams=False)


def _pull_object(store: Store, client: AgentClient, kind: str, oid: str, role: str, opts: Options,
                 progress: Progress, picker: CodecPicker | None = None, like: str | None = None) -> ObjectReport:
    t0 = time.monotonic()
    picker = picker or opts.picker(STREAM_LEVEL_PULL)
    used: dict[str, int] = {}
    used_lock = threading.Lock()
    wire0 = client.wire_bytes
    liked = (like, object_manifest(store, "file", like)) if like and opts.like else None
    expect, head = _fetch_expectation(client, kind, oid, opts.hash_len, liked)
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

        pacer = Pacer(opts.batch, opts.inflight, client.timeout, meter=picker.meter)

        def fetch(batch: list[int]) -> None:
            idx = encode_indices(batch)
            codec = picker.choose(PULL_CODECS)   # the serving side compresses at the level asked for
            with pacer.flight(len(batch)) as sent:   # a few seconds' worth of answers in flight, no more
                resp = client.request("POST", f"/v1/objects/{kind}/{oid}/read", content=idx,
                                      params={"level": codec.level or 1, "compress": str(codec != NONE).lower()},
                                      idempotent=True)
                sent.append(len(idx) + len(resp.content))
            with used_lock:
                used[codec.label] = used.get(codec.label, 0) + len(batch) * BLOCK_SIZE
            try:
                blocks = unpack_blocks(resp.content, len(batch), compressed=codec != NONE)
                sample = picker.probe(PULL_CODECS, lambda: b"".join(blocks[:codecpick.PROBE_BLOCKS]))
                picker.record(codec, len(batch) * BLOCK_SIZE, len(resp.content), sample=sample)
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
                        stats.fetched_bytes, client.wire_bytes - wire0, time.monotonic() - t0).used(picker, used)


def _fetch_record(client: AgentClient, ref: str) -> dict[str, Any]:
    """The version record of ``NAME[@V]`` at the agent, checked (it comes from another host)."""
    r = parse_ref(ref)
    record = client.get_json(f"/v1/capsules/{r.name}/versions/{r.version or 'latest'}")
    try:
        return validate(record)
    except Exception as exc:
        raise TransferFailed(f"the agent at {client.url} sent a malformed version record: {exc}") from exc


def _pull_missing(store: Store, client: AgentClient, report: TransferReport, items: list[tuple[str, str, str]],
                  opts: Options, progress: Progress, record: dict[str, Any] | None = None) -> None:
    """Pull each (kind, id, role) this store lacks; the rest are recorded as skipped. One codec picker
    for them all: what the link and the data showed for one object counts for the next. ``record``: the
    version they are of (its memory image's records are asked against an older one held here)."""
    picker = opts.picker(STREAM_LEVEL_PULL)
    like = held_like(store, record) if record is not None and record.get("memory") else None
    for kind, oid, role in items:
        if has_object(store, kind, oid):
            report.skipped.append(oid)
        else:
            mine = like if record is not None and oid == record.get("memory") else None
            report.objects.append(_pull_object(store, client, kind, oid, role, opts, progress, picker, mine))


def pull(store: Store, url: str, ref: str, token: str, opts: Options | None = None,
         progress: Progress | None = None, *, transport: Transport | None = None,
         fingerprint: str | None = None) -> TransferReport:
    """Fetch ``NAME[@V]`` from the agent at ``url`` into ``store`` (over ``transport`` if given, e.g. an
    in-process one; over https pinned to ``fingerprint`` or the known host's)."""
    opts = opts or Options()
    progress = progress or Progress()
    t0 = time.monotonic()
    with agent_client(store, url, token, fingerprint, transport) as client:
        record = _fetch_record(client, ref)
        report = TransferReport("pull", f"{record['capsule']}@{record['number']}", url)
        layers, files = objects_of(record)
        _pull_missing(store, client, report, [("layer", lid, "layer") for lid in layers]
                      + [("file", f, ro) for f, ro in files], opts, progress, record)
        _row, report.recorded = record_version(store, record)
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
        _pull_missing(store, client, report, [("file", f, ro) for f, ro in files], opts, progress, record)
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
