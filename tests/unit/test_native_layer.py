"""Property tests: a layer's manifest built by the extension (``Qcow2Image.own_records``: each L2 table
walked, its data read and hashed on every core) equals the reference, run by run through
``iter_block_runs`` — for layers written by qcow2_writer (data, zero and zero-content blocks, a short
last block, several clusters and tables) and for mutated ones, which give the very same error or the very
same manifest (qemu-img's own images: tests/tools/test_native_layer.py)."""

from __future__ import annotations

import random
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import HashcacheError
from hashcache.manifest import Manifest, _reference_manifest_of_layer, manifest_of_layer
from hashcache.qcow2 import Qcow2Image
from hashcache.qcow2_writer import write_layer
from tests.helpers.fuzzing import EDGE_INTS

CLUSTER = 128 * 1024
prop = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layers(draw: st.DrawFn) -> tuple[int, dict[int, bytes | None]]:
    """(virtual size, {block: data — random, all zero bytes, or None for a zero block})."""
    size = draw(st.integers(1, 5 * CLUSTER // BLOCK_SIZE)) * BLOCK_SIZE - draw(st.sampled_from([0, 0, 512, 3584]))
    nblocks = -(-size // BLOCK_SIZE)
    rng = random.Random(draw(st.integers(0, 2**32)))
    kinds = st.sampled_from(["data", "data", "data", "zero", "zeros"])
    picked = draw(st.dictionaries(st.integers(0, nblocks - 1), kinds, max_size=120))
    blocks: dict[int, bytes | None] = {i: None if k == "zero" else bytes(BLOCK_SIZE) if k == "zeros"
                                       else rng.randbytes(BLOCK_SIZE) for i, k in picked.items()}
    return size, blocks


def _write(path: Path, layer: tuple[int, dict[int, bytes | None]]) -> None:
    size, blocks = layer
    write_layer(path, virtual_size=size, backing=None, records=[(i, blocks[i] is None) for i in sorted(blocks)],
                read_block=lambda i: blocks[i] or bytes(BLOCK_SIZE))


def _outcome(fn, path: Path) -> tuple[str, str] | Manifest:  # type: ignore[no-untyped-def]
    try:
        return fn(path, None)
    except HashcacheError as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.unit
@prop
@given(layers())
def test_written_layers_agree(layer: tuple[int, dict[int, bytes | None]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "layer.qcow2"
        _write(path, layer)
        with Qcow2Image(path) as img:
            assert img.own_records() is not None  # the extension took it
        got, ref = manifest_of_layer(path, None), _reference_manifest_of_layer(path, None)
        assert got.record_bytes == ref.record_bytes and got.digest == ref.digest


@st.composite
def mutated_layers(draw: st.DrawFn) -> bytes:
    """A written layer with table entries (L1, L2) overwritten: edge values, reserved or compressed
    bits, offsets past the end, zero and allocation bitmaps that contradict; sometimes truncated."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "layer.qcow2"
        _write(path, draw(layers()))
        data = bytearray(path.read_bytes())
        with Qcow2Image(path) as img:  # where the allocated L2 entries are: words worth aiming at
            words = [(img._l1[t] & 0x00FF_FFFF_FFFF_FE00) + 16 * i  # noqa: SLF001
                     for t in range(len(img._l1)) if img._l1[t]  # noqa: SLF001
                     for i in range(img.l2_entries)
                     if data[(img._l1[t] & 0x00FF_FFFF_FFFF_FE00) + 16 * i:][:16] != bytes(16)]  # noqa: SLF001
    for _ in range(draw(st.integers(0, 2)) if words else 0):  # an allocated entry or its bitmap changed
        at = draw(st.sampled_from(words)) + draw(st.sampled_from([0, 8]))
        (old,) = struct.unpack_from(">Q", data, at)
        flip = draw(st.sampled_from([1, 1 << 62, 1 << 3, 1 << 32, 0xFFFF_FFFF << 32, 1 << 9, 1 << 40]))
        data[at:at + 8] = struct.pack(">Q", old ^ flip)
    for _ in range(draw(st.integers(0, 2))):
        cluster = draw(st.integers(1, max(1, len(data) // CLUSTER - 1)))
        at = cluster * CLUSTER + 8 * draw(st.integers(0, 15))
        value = draw(st.sampled_from(EDGE_INTS) | st.integers(0, 2**64 - 1)
                     | st.integers(0, len(data) // 512).map(lambda c: c * 512)
                     | st.sampled_from([1 << 62, 0xFFFF_FFFF_FFFF_FFFF, 0x0000_0001_0000_0001]))
        data[at:at + 8] = struct.pack(">Q", value)
    if draw(st.integers(0, 4)) == 0:
        del data[draw(st.integers(len(data) // 2, len(data))):]
    return bytes(data)


@pytest.mark.unit
@prop
@given(mutated_layers())
def test_mutated_layers_agree(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "layer.qcow2"
        path.write_bytes(data)
        got, ref = _outcome(manifest_of_layer, path), _outcome(_reference_manifest_of_layer, path)
        if isinstance(ref, Manifest):
            assert isinstance(got, Manifest) and got.record_bytes == ref.record_bytes
        else:
            assert got == ref
