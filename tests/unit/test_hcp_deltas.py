"""HCP deltas (hashcache/delta.py, capsule/transfer/similar.py): a block the receiver lacks travels as a zstd
delta against similar blocks it holds, is rebuilt, checked against its hash and kept whole. Round trips
of random and near-copy blocks; the bounds on what a receiver takes; through the agent's real HTTP
handling (``create_app``, in-process): a delta whose result fails its hash is refused naming the block and
keeps nothing, a push of a child layer whose blocks changed slightly sends deltas, an older receiver (no
``X-Capsule-Deltas``) and references the receiver cannot read get blocks whole; with the codec left to the link,
deltas that pay are picked after a trial, and ``--no-deltas`` and codecs given override the pick. The ext4
source (same path in the parent) needs debugfs: tests/tools/test_hcp_deltas_ext4.py."""

from __future__ import annotations

import contextlib
import random
import struct
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsule import transfer
from capsule.agentclient import AgentClient
from capsule.store import Store
from capsule.store.objectio import has_object
from capsule.transfer import deltapick, extmap, pushing
from hashcache import delta
from hashcache.blocks import BLOCK_SIZE, hash_block
from hashcache.hcp import Expectation, ProtocolError, decode_indices, encode_indices
from hashcache.qcow2_writer import write_layer
from hashcache.transport.memory import in_process
from tests.helpers.transport_fixtures import TOKEN, agent_app

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

SIZE = 1 << 20            # 256 blocks
BLOCKS = 96


def _near(block: bytes, rng: random.Random, edits: int) -> bytes:
    buf = bytearray(block)
    for _ in range(edits):
        at = rng.randrange(BLOCK_SIZE - 8)
        buf[at:at + 8] = rng.randbytes(8)
    return bytes(buf)


# -- the encoding ----------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), nrefs=st.integers(1, 6), nblocks=st.integers(1, 6), edits=st.integers(0, 40),
       random_blocks=st.booleans())
def test_a_delta_rebuilds_its_blocks_exactly(seed, nrefs, nblocks, edits, random_blocks):
    rng = random.Random(seed)
    where = rng.sample(range(100), nrefs)   # reference blocks of the parent's disk, in dictionary order
    refs = [rng.randbytes(BLOCK_SIZE) for _ in range(nrefs)]
    blocks = [rng.randbytes(BLOCK_SIZE) if random_blocks else _near(rng.choice(refs), rng, edits)
              for _ in range(nblocks)]
    indices = sorted(rng.sample(range(1000), nblocks))
    d = delta.encode(indices, blocks, where, refs)
    assert delta.blocks_of(d.refs) == where and d.indices == tuple(indices)
    [back] = delta.unpack(delta.pack([d]), indices, 100)
    assert back == d and delta.rebuild(back, refs) == blocks
    if not random_blocks and edits <= 4:
        assert d.wire_size < 100 + 60 * nblocks + 10 * nrefs, d.wire_size   # a near copy: a few bytes an edit


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), count=st.integers(1, 8))
def test_many_records_rebuild_their_own_blocks(seed, count):
    """Records interleave: each names its own blocks, the upload's envelope all of them."""
    rng = random.Random(seed)
    disk = [rng.randbytes(BLOCK_SIZE) for _ in range(32)]   # the parent's disk
    slots = rng.sample(range(5000), count * 3)
    records, truth = [], {}
    for k in range(count):
        start = rng.randrange(28)
        where = list(range(start, start + rng.randint(1, 4)))   # a run, as a file's old blocks mostly are
        mine = sorted(rng.sample(slots[3 * k:3 * k + 3], rng.randint(1, 3)))
        blocks = [_near(disk[rng.choice(where)], rng, rng.randint(0, 5)) for _ in mine]
        truth.update(zip(mine, blocks, strict=True))
        records.append(delta.encode(mine, blocks, where, [disk[j] for j in where]))
    assert all(len(d.refs) == 1 for d in records)
    got = delta.unpack(delta.pack(records), sorted(truth), len(disk))
    good, unresolved = delta.rebuild_all("x", got, lambda j: disk[j], lambda i: hash_block(truth[i]))
    assert dict(good) == truth and unresolved == []


def test_what_a_receiver_takes_is_bounded():
    ref = random.Random(1).randbytes(BLOCK_SIZE)
    good = delta.encode([5], [ref[::-1]], [7], [ref])
    rec = delta.pack([good])   # u16 1, index 5, u16 1 run, (u64 7, u16 1), u32 frame length, frame
    run_at, frame_at = 5, 15
    for bad, idx, why in [
        (rec[:-1], [5], "truncated"),
        (rec[:3], [5], "truncated"),
        (rec + rec, [5], "names blocks the upload does not"),
        (rec, [5, 6], "in none of its records"),
        (rec, [4], "beyond the object|names blocks the upload does not"),
        (rec[:3] + struct.pack("<H", 1) + struct.pack("<QH", 7, delta.MAX_REFS + 1) + rec[frame_at:], [5],
         "reference blocks"),
        (rec[:3] + struct.pack("<H", 1) + struct.pack("<QH", 7, 0) + rec[frame_at:], [5], "reference blocks"),
        (rec[:run_at] + struct.pack("<QH", 2**63, 1) + rec[frame_at:], [5], "beyond the parent's disk"),
        (rec[:run_at] + struct.pack("<QH", 99, 2) + rec[frame_at:], [5], "beyond the parent's disk"),
        (rec[:frame_at] + struct.pack("<I", BLOCK_SIZE + delta.FRAME_SLACK + 1) + rec[frame_at + 4:], [5],
         "frame of"),
    ]:
        with pytest.raises(ProtocolError, match=why):
            delta.unpack(bad, idx, 100)
    assert delta.unpack(rec, [5], 100) == [good]
    import zstandard
    big = zstandard.ZstdCompressor().compress(bytes(2 * BLOCK_SIZE))   # declares 8 KiB for one block
    with pytest.raises(ProtocolError, match="declare"):
        delta.rebuild(delta.Delta((5,), good.refs, big), [ref])
    with pytest.raises(ProtocolError, match="bad delta frame"):
        delta.rebuild(delta.Delta((5,), good.refs, good.frame[:-2]), [ref])   # declares 4 KiB, is cut short


# -- through the agent app -----------------------------------------------------------------------------

def _layer(store: Store, blocks: dict[int, bytes], parent: str | None) -> str:
    leaf = store.new_leaf_path()
    write_layer(leaf, virtual_size=max(SIZE, (max(blocks) + 1) * BLOCK_SIZE),
                backing=str(store.layer_path(parent)) if parent else None,
                records=[(i, False) for i in sorted(blocks)], read_block=blocks.__getitem__)
    row = store.seal_layer(leaf, parent)
    with store.catalogue.transaction():
        store.catalogue.add_layer(row)
    return row.id


def _versions(seed: int = 7, blocks: int = BLOCKS, every: int = 2) -> tuple[dict[int, bytes], dict[int, bytes]]:
    """A parent's blocks and its child's: each of the child's (every ``every``-th block) a near copy of the
    parent's block there."""
    rng = random.Random(seed)
    base = {i: rng.randbytes(BLOCK_SIZE) for i in range(blocks)}
    child = {i: _near(base[i], rng, 3) for i in range(0, blocks, every)}
    return base, child


@contextlib.contextmanager
def _pair(tmp_path: Path, seed: int = 7, blocks: int = BLOCKS, every: int = 2):
    """A source store with a root layer and a child of it; the receiving agent's store holds the root."""
    base, child = _versions(seed, blocks, every)
    src = Store.open(tmp_path / "src")
    root = _layer(src, base, None)
    top = _layer(src, child, root)
    dst = Store.open(tmp_path / "dst")
    assert _layer(dst, base, None) == root
    dst.close()
    with agent_app(tmp_path / "dst") as agent:
        yield src, agent, root, top, child
    src.close()


class _Count:
    """A transport wrapper: the receiver's answers to delta uploads, summed; ``hide`` drops the header by
    which a receiver offers deltas (an older release); ``rate``: bytes/s of a slow link the uploads take."""

    def __init__(self, inner, hide: bool = False, rate: float | None = None) -> None:
        self.inner, self.url, self.hide, self.rate = inner, inner.url, hide, rate
        self.rebuilt = self.unresolved = self.delta_uploads = 0
        self.link = threading.Lock()

    def call(self, call):
        if self.rate:   # a slow link, one for all requests: an upload takes its bytes' time on it
            with self.link:
                time.sleep(len(call.content) / self.rate)
        reply = self.inner.call(call)
        if call.path.endswith("/begin") and self.hide:
            reply.headers.pop(delta.DELTAS_HEADER, None)
        if call.path.endswith("/blocks") and (call.params or {}).get("delta"):
            self.delta_uploads += 1
            body = reply.json()
            self.rebuilt += body["rebuilt"]
            self.unresolved += body["unresolved"]
        return reply

    def close(self):
        self.inner.close()


@pytest.fixture(autouse=True)
def _no_ext4(monkeypatch):
    """No guest file system here (flattening a disk starts qemu-img): the parent's block at the same offset
    is the only reference."""
    monkeypatch.setattr(extmap, "layer_views", lambda *a: contextlib.nullcontext(None))


def _push(src: Store, agent, top: str, wrap=None, **opts) -> tuple[transfer.ObjectReport, _Count]:
    counter = _Count(in_process(agent.app, TOKEN, stream=False), **(wrap or {}))
    client = AgentClient("http://dst.example", TOKEN, transport=counter)
    try:
        report = pushing._push_object(src, client, "layer", top, "layer", transfer.Options(**{"xz": True, **opts}),
                                      transfer.Progress())
    finally:
        client.close()
    assert report is not None
    return report, counter


def _installed(home: Path, top: str) -> bool:
    s = Store.open(home)
    try:
        return has_object(s, "layer", top) and s.layer_manifest(top).digest == top
    finally:
        s.close()


def test_a_child_whose_blocks_changed_slightly_travels_as_deltas(tmp_path):
    with _pair(tmp_path) as (src, agent, _root, top, child):
        report, seen = _push(src, agent, top)
        assert _installed(tmp_path / "dst", top)
    assert seen.rebuilt == len(child) == report.delta_blocks and seen.unresolved == 0, vars(seen)
    with _pair(tmp_path / "again") as (src, agent, _root, top, _child):
        whole, plain = _push(src, agent, top, deltas=False)
        assert _installed(tmp_path / "again" / "dst", top)
    assert plain.delta_uploads == 0 and whole.delta_blocks == 0
    print(f"wire bytes of {len(child)} near-copy blocks: {report.wire_bytes} as deltas, {whole.wire_bytes} whole")
    assert report.wire_bytes * 10 < whole.wire_bytes, (report.wire_bytes, whole.wire_bytes)


def test_a_receiver_that_does_not_offer_deltas_gets_blocks_whole(tmp_path):
    with _pair(tmp_path) as (src, agent, _root, top, _child):
        report, seen = _push(src, agent, top, wrap={"hide": True})
        assert _installed(tmp_path / "dst", top)
    assert seen.delta_uploads == 0 and report.delta_blocks == 0


def test_blocks_whose_references_the_receiver_cannot_read_are_sent_again_whole(tmp_path, monkeypatch):
    real = delta.rebuild_all
    monkeypatch.setattr(delta, "rebuild_all", lambda name, ds, read, exp: real(name, ds, lambda j: None, exp))
    with _pair(tmp_path) as (src, agent, _root, top, child):
        report, seen = _push(src, agent, top)
        assert _installed(tmp_path / "dst", top)
    assert seen.unresolved == len(child) and seen.rebuilt == 0 and report.delta_blocks == 0


def test_with_the_codec_left_to_the_link_deltas_that_pay_are_picked(tmp_path):
    """No codec given, a link of 4 MB/s: once the link is measured, a trial on a slice's first blocks
    finds deltas of near copies (a fiftieth of their bytes) sooner than whole random blocks, and the pick
    sends the later slices' as deltas too, saying so in the report."""
    with _pair(tmp_path, blocks=4 * deltapick.SLICE_BLOCKS, every=1) as (src, agent, _root, top, child):
        report, seen = _push(src, agent, top, wrap={"rate": 4e6}, xz=False)
        assert _installed(tmp_path / "dst", top)
    fig = report.delta_figures
    print(f"deltas {report.deltas}: {fig}; {report.delta_blocks} blocks as deltas of {len(child)}")
    assert report.deltas == "used" and fig["with_s_per_mb"] < fig["without_s_per_mb"], (report.deltas, fig)
    assert deltapick.SLICE_BLOCKS < report.delta_blocks == seen.rebuilt, (report.delta_blocks, vars(seen))


def test_no_deltas_and_codecs_given_override_the_link_pick(tmp_path):
    """``--no-deltas`` and a frame codec given (zstd -3) send no delta; a stream codec given sends every
    block that pays as one, with no trial."""
    for label, opts, expect in (("off", {"deltas": False}, 0), ("z3", {"xz": False, "level": 3}, 0),
                                ("z19", {"xz": False, "level": 19}, BLOCKS // 2)):
        with _pair(tmp_path / label) as (src, agent, _root, top, _child):
            report, seen = _push(src, agent, top, **opts)
            assert _installed(tmp_path / label / "dst", top)
        assert report.delta_blocks == seen.rebuilt == expect, (label, report, vars(seen))
        assert report.deltas == ("given" if expect else ""), (label, report.deltas)


def test_a_delta_whose_result_fails_its_hash_is_refused_and_keeps_nothing(tmp_path):
    from starlette.testclient import TestClient

    with _pair(tmp_path) as (src, agent, _root, top, child):
        m = src.layer_manifest(top)
        http = TestClient(agent.app)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        import zstandard
        part = Expectation.part_of(m, 0, len(m), 8)
        r = http.post(f"/v1/recv/layer/{top}/begin", content=zstandard.ZstdCompressor().compress(part.to_bytes()),
                      headers=auth)
        assert r.status_code == 200 and r.headers[delta.DELTAS_HEADER] == "1", r.text
        needed = decode_indices(zstandard.ZstdDecompressor().decompress(r.content, max_output_size=1 << 20), 1 << 20)
        assert needed == sorted(child)
        base, _c = _versions()
        first, second = needed[:2]
        wrong = bytearray(child[second])
        wrong[100] ^= 1   # rebuilds to a block that is not the one the manifest names
        ds = [delta.encode([first], [child[first]], [first], [base[first]]),
              delta.encode([second], [bytes(wrong)], [second], [base[second]])]
        idx = encode_indices([first, second])
        body = struct.pack("<I", len(idx)) + idx + delta.pack(ds)
        r = http.post(f"/v1/recv/layer/{top}/blocks", params={"delta": "true"}, content=body, headers=auth)
        assert r.status_code == 422 and r.json()["error"] == "integrity", r.text
        assert f"block {second}" in r.json()["detail"], r.text
        r = http.post(f"/v1/recv/layer/{top}/lacking", content=idx, headers=auth)
        assert decode_indices(r.content, 1 << 20) == [first, second], "a block of the refused upload was kept"
        r = http.post(f"/v1/recv/layer/{top}/blocks", params={"delta": "true"}, content=body[:-3], headers=auth)
        assert r.status_code == 400 and "delta" in r.json()["detail"], r.text
