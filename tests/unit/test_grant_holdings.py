"""A pusher learns nothing about blocks it may not read, through the agent's real HTTP (``create_app``): a push
grant's ``begin`` counts as held only blocks of objects the grant may read (its record's, and those of its
capsule's versions here when the record is that capsule's), and a layer whose manifest names a parent outside
them is refused — at ``begin`` and at a delta upload — with nothing kept; asked which objects this host lacks,
it is told of no other capsule's. A user's host token keeps every holding. (Before, the plan said which of
another capsule's blocks this host holds, and a delta against another capsule's layer said by 422 or stored
whether a guess of its block was right.)"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import zstandard

from capsule.store.objectio import object_path
from hashcache import delta
from hashcache.blocks import BLOCK_SIZE
from hashcache.hcp import Expectation, decode_indices, encode_indices
from hashcache.manifest import Manifest, manifest_of_layer
from hashcache.qcow2_writer import write_layer
from tests.helpers.grantworld import A, World, bearer, make_world
from tests.helpers.received import record_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSULE_HASHCACHE_SIZE", str(1 << 20))
    w = make_world(tmp_path)
    for kind, ids in (("layer", ("root", "a_layer", "b_layer")), ("file", ("kernel", "initrd", "a_mem", "b_mem"))):
        for key in ids:      # every object of the host in its hash cache, as sealing and receiving put them
            oid = w.o[key]
            m = w.store.layer_manifest(oid) if kind == "layer" else w.store.file_manifest(oid)
            w.store.index_object(object_path(w.store, kind, oid), m)
    yield w
    w.store.close()


def _mem_block(seed: int, k: int) -> bytes:
    """Block ``k`` of the memory image ``receive_file`` made with ``seed``."""
    return bytes([seed % 251 + 1, k % 251]) * (BLOCK_SIZE // 2)


ROOT_BLOCK = bytes([4]) * BLOCK_SIZE          # the shared root layer's (receive_layer seed 3)
B_LAYER_BLOCK = bytes([7]) * BLOCK_SIZE       # only bob's layer holds it (seed 6)
B_MEM_BLOCK = _mem_block(7, 0)                # only bob's memory image (seed 7)
A_MEM_BLOCK = _mem_block(5, 0)                # only alice's memory image (seed 5)


def _layer(work: Path, name: str, blocks: dict[int, bytes], parent: str) -> Manifest:
    src = work / f"{name}.qcow2"
    write_layer(src, virtual_size=64 * BLOCK_SIZE, backing=f"{parent}.qcow2",
                records=[(i, False) for i in sorted(blocks)], read_block=blocks.__getitem__)
    return manifest_of_layer(src, parent)


def _begin(w: World, m: Manifest, headers: dict[str, str]):
    part = Expectation.part_of(m, 0, len(m), 8)
    return w.client.post(f"/v1/recv/layer/{m.digest}/begin",
                         content=zstandard.ZstdCompressor().compress(part.to_bytes()), headers=headers)


def _needed(reply) -> list[int]:
    assert reply.status_code == 200, reply.text
    return decode_indices(zstandard.ZstdDecompressor().decompress(reply.content, max_output_size=1 << 20), 1 << 20)


def _grant(w: World, record: dict) -> dict[str, str]:
    return bearer(w.grant(allow="push", record=record))


def _probe(w: World, extra: int) -> Manifest:
    """A layer over the root whose blocks are: the root's, bob's layer's, bob's memory's, alice's memory's and
    one no host has (``extra`` makes it another object)."""
    fresh = random.Random(extra).randbytes(BLOCK_SIZE)
    return _layer(w.work, f"probe-{extra}", {0: ROOT_BLOCK, 1: B_LAYER_BLOCK, 2: B_MEM_BLOCK, 3: A_MEM_BLOCK,
                                             4: fresh}, w.o["root"])


def test_a_push_grant_is_not_told_which_of_another_capsules_blocks_are_held(world):
    """A grant for a new capsule: of its layer's blocks only the root's (in its record's chain) are held. An
    operator's or admin's host token, on the same host, is told of every block held."""
    w = world
    m = _probe(w, 1)
    g = _grant(w, record_of("pushed", 1, [w.o["root"], m.digest], w.o["kernel"], w.o["initrd"]))
    assert _needed(_begin(w, m, g)) == [1, 2, 3, 4]      # bob's and alice's blocks asked for again
    for who, extra in (("admin", 5), ("host", 6)):
        assert _needed(_begin(w, _probe(w, extra), bearer(w.t[who]))) == [4], who


def test_a_push_grant_gets_dedup_against_its_own_capsules_versions(world):
    """A grant for alice's capsule (its record carries her capsule's uuid): her other versions' memory image
    counts as held, the root of its chain too; bob's blocks do not."""
    w = world
    m = _probe(w, 2)
    uuid = w.store.catalogue.capsule(A).uuid
    record = record_of(A, 9, [w.o["root"], m.digest], w.o["kernel"], w.o["initrd"]) | {"uuid": uuid}
    assert _needed(_begin(w, m, _grant(w, record))) == [1, 2, 4]
    # the same capsule name under another uuid is another capsule: nothing of alice's versions
    other = _probe(w, 3)
    record = record_of(A, 10, [w.o["root"], other.digest], w.o["kernel"], w.o["initrd"])
    record["uuid"] = "123e4567-e89b-12d3-a456-426614174000"
    assert _needed(_begin(w, other, _grant(w, record))) == [1, 2, 3, 4]


def _delta_upload(index: int, block: bytes, ref: int, ref_block: bytes) -> bytes:
    idx = encode_indices([index])
    return struct.pack("<I", len(idx)) + idx + delta.pack([delta.encode([index], [block], [ref], [ref_block])])


def test_a_delta_parent_the_grant_may_not_read_is_refused_and_nothing_is_kept(world):
    """A layer of the pushed record whose manifest names bob's layer as parent: refused at begin (before, a
    right guess of bob's block was stored and a wrong one answered 422); a receive begun by a host token meanwhile
    takes no delta of the grant's either. A parent in the record's chain still takes deltas."""
    w = world
    near = bytearray(B_LAYER_BLOCK)
    near[100:108] = b"guessed!"
    spy = _layer(w.work, "spy", {0: bytes(near)}, w.o["b_layer"])
    mine = _layer(w.work, "mine", {0: ROOT_BLOCK[:-8] + b"changed!"}, w.o["root"])
    record = record_of("pushed", 1, [w.o["root"], spy.digest], w.o["kernel"], w.o["initrd"])
    record["chains"].append([w.o["root"], mine.digest])
    g = _grant(w, record)
    r = _begin(w, spy, g)
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    assert w.o["b_layer"][:12] in r.json()["detail"] and "may read" in r.json()["detail"], r.text
    recv = w.store.home / "recv"
    assert not recv.exists() or not list(recv.glob(f"*{spy.digest}*")), "a refused begin kept something"
    upload = _delta_upload(0, bytes(near), 0, B_LAYER_BLOCK)
    r = w.client.post(f"/v1/recv/layer/{spy.digest}/blocks", params={"delta": "true"}, content=upload, headers=g)
    assert r.status_code in (403, 404) and r.json()["error"] in ("forbidden", "not_found"), r.text

    host = bearer(w.t["host"])
    assert _needed(_begin(w, spy, host)) == [0]          # an operator's push of it began
    r = w.client.post(f"/v1/recv/layer/{spy.digest}/blocks", params={"delta": "true"}, content=upload, headers=g)
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    r = w.client.post(f"/v1/recv/layer/{spy.digest}/lacking", content=encode_indices([0]), headers=host)
    assert decode_indices(r.content, 1 << 20) == [0], "the grant's delta against bob's layer was kept"

    assert _needed(_begin(w, mine, g)) == [0]            # its own parent: deltas rebuilt and kept
    changed = ROOT_BLOCK[:-8] + b"changed!"
    r = w.client.post(f"/v1/recv/layer/{mine.digest}/blocks", params={"delta": "true"},
                      content=_delta_upload(0, changed, 0, ROOT_BLOCK), headers=g)
    assert r.status_code == 200 and r.json()["rebuilt"] == 1, r.text


def test_a_push_grant_is_not_told_which_of_another_capsules_objects_are_held(world):
    """``POST /v1/objects/missing``, asked before a push: a grant is told that the objects of its record held here
    are held, and another capsule's are missing (before, that bob's layer and memory image are here)."""
    w = world
    m = _probe(w, 7)
    g = _grant(w, record_of("pushed", 1, [w.o["root"], m.digest], w.o["kernel"], w.o["initrd"]))
    ask = {"layers": [w.o["root"], m.digest, w.o["b_layer"]], "files": [w.o["kernel"], w.o["b_mem"]]}
    r = w.client.post("/v1/objects/missing", json=ask, headers=g)
    assert r.status_code == 200, r.text
    assert r.json() == {"layers": [m.digest, w.o["b_layer"]], "files": [w.o["b_mem"]]}
    r = w.client.post("/v1/objects/missing", json=ask, headers=bearer(w.t["host"]))
    assert r.json() == {"layers": [m.digest], "files": []}
