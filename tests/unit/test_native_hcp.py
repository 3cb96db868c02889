"""Property tests: the compiled extension and the pure-Python reference agree on HCP's wire batches
(zstd frames byte for byte, the blocks unpacked, the same refusal for corrupt or wrong-sized
payloads), on the receiver's check of fetched blocks (the same blocks kept, the same error naming
the same block) and on the blocks a shadow ends up holding."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import HashcacheError
from hashcache.hcp import Receiver, _reference_pack, _reference_unpack, pack_blocks, unpack_blocks
from hashcache.manifest import manifest_of_file
from hashcache.shadow import Shadow

pytestmark = pytest.mark.unit

prop = settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _blocks(seed: int, kinds: list[int]) -> list[bytes]:
    """0: zero, 1: random, 2: text-like (compressible), 3: repeat of an earlier block."""
    rng = random.Random(seed)
    out: list[bytes] = []
    for k in kinds:
        if k == 0:
            out.append(bytes(BLOCK_SIZE))
        elif k == 1:
            out.append(rng.randbytes(BLOCK_SIZE))
        elif k == 2:
            line = f"{rng.randrange(10**9)} lorem ipsum\n".encode()
            out.append((line * (BLOCK_SIZE // len(line) + 1))[:BLOCK_SIZE])
        else:
            out.append(rng.choice(out) if out else bytes(BLOCK_SIZE))
    return out


seeds = st.integers(0, 2**32)
kind_lists = st.lists(st.integers(0, 3), min_size=1, max_size=64)


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except HashcacheError as exc:
        return type(exc).__name__, None


@prop
@given(seeds, kind_lists, st.integers(1, 9), st.booleans())
def test_batches_agree(seed: int, kinds: list[int], level: int, compress: bool) -> None:
    blocks = _blocks(seed, kinds)
    payload = pack_blocks(blocks, level=level, compress=compress)
    assert payload == _reference_pack(blocks, level=level, compress=compress)
    assert unpack_blocks(payload, len(blocks), compress) == _reference_unpack(payload, len(blocks), compress) == blocks


@prop
@given(seeds, kind_lists, st.sampled_from(["truncate", "flip", "garbage", "count", "append"]), st.data())
def test_corrupt_batches_refused_alike(seed: int, kinds: list[int], how: str, data: st.DataObject) -> None:
    blocks = _blocks(seed, kinds)
    payload = bytearray(pack_blocks(blocks))
    count = len(blocks)
    if how == "truncate":
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    elif how == "flip":
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] ^= data.draw(st.integers(1, 255))
    elif how == "garbage":
        payload = bytearray(data.draw(st.binary(max_size=64)))
    elif how == "count":
        count = data.draw(st.integers(0, 2 * count).filter(lambda c: c != len(blocks)))
    else:
        payload += pack_blocks(blocks[:1])
    assert _outcome(unpack_blocks, bytes(payload), count) == _outcome(_reference_unpack, bytes(payload), count)


@prop
@given(seeds, kind_lists, st.lists(st.integers(0, 63), max_size=3), st.sampled_from([8, 32]), st.booleans())
def test_receiver_checks_agree(tmp_path_factory: pytest.TempPathFactory, seed: int, kinds: list[int],
                               bad: list[int], hash_len: int, foreign: bool) -> None:
    """Fetched blocks, some corrupted (and maybe one index that is no data block): the extension's batch
    check keeps the same blocks and raises the same error for the same block as the reference loop."""
    blocks = _blocks(seed, kinds)
    work = tmp_path_factory.mktemp("r")
    path = work / "obj"
    path.write_bytes(b"".join(blocks))
    m = manifest_of_file(path)
    from hashcache.hcp import Expectation

    expect = Expectation.part_of(m, 0, len(m), hash_len)
    indices = [i for i, z, _h in m.records() if not z]
    sent = [blocks[i] for i in indices]
    for b in bad:
        if b < len(sent):
            sent[b] = bytes(x ^ 0x5A for x in sent[b])
    if foreign and len(blocks) > len(indices):  # ask for a zero block too
        zero_index = next(i for i in range(len(blocks)) if i not in set(indices))
        indices, sent = [*indices, zero_index], [*sent, bytes(BLOCK_SIZE)]
    results = []
    for which in ("native", "reference"):
        with Shadow(work / which, m.block_count) as sh:
            r = Receiver(expect, sh, "file x", dedupe=False)
            if which == "reference":
                r.accept = _reference_accept.__get__(r)  # type: ignore[method-assign]
            err = _outcome(r.accept, indices, sent)[0]
            results.append((err, sorted(i for i in range(m.block_count) if sh.has(i)),
                            sh.read_run(0, m.block_count)))
    assert results[0] == results[1]


def _reference_accept(self: Receiver, indices, blocks) -> None:
    good: list[tuple[int, bytes]] = []
    try:
        self._reference_verify(indices, blocks, good)
    finally:
        self._store(good, "fetched_bytes", None)


@prop
@given(seeds, st.lists(st.integers(0, 200), min_size=1, max_size=40, unique=True), st.booleans())
def test_shadow_writes_agree(tmp_path_factory: pytest.TempPathFactory, seed: int, indices: list[int],
                             durable: bool) -> None:
    rng = random.Random(seed)
    batch = [(i, rng.randbytes(BLOCK_SIZE)) for i in indices]
    work = tmp_path_factory.mktemp("s")
    with Shadow(work / "a", 201) as a, Shadow(work / "b", 201) as b:
        a.store(batch, durable=durable)
        b._reference_write(batch, durable)
        b.mark_present(i for i, _ in batch)
        assert a.read_run(0, 201) == b.read_run(0, 201)
        assert [a.has(i) for i in range(201)] == [b.has(i) for i in range(201)]
    assert Path(work / "a.data").read_bytes() == Path(work / "b.data").read_bytes()
