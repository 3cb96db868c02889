"""Fuzzing the qcow2 reader (hashcache/qcow2.py): a layer file may come from a peer (it is checked
against its manifest only after it has been read), so its header, header extensions, L1 and L2
tables are bytes from outside. Layers written by qcow2_writer round-trip through the reader; mutated
ones (header fields, table entries with reserved bits, offsets beyond the file, huge sizes) give
CorruptImageError / UnsupportedImageError, nothing else, and reading them stays bounded."""

from __future__ import annotations

import contextlib
import struct
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from hashcache.blocks import BLOCK_SIZE
from hashcache.errors import HashcacheError
from hashcache.manifest import manifest_of_layer
from hashcache.qcow2 import MAGIC, Qcow2Image
from hashcache.qcow2_writer import write_layer
from tests.helpers.fuzzing import EDGE_INTS, MARKS, fuzz_files, mutated

pytestmark = MARKS

CLUSTER = 128 * 1024
MAX_RUNS = 64  # runs read per example: a mutated virtual size may be petabytes of unallocated blocks


@st.composite
def layers(draw: st.DrawFn) -> tuple[int, str | None, dict[int, bytes | None]]:
    """(virtual size, backing name, {block: data, or None for a zero block})."""
    size = draw(st.integers(1, 3 * CLUSTER // BLOCK_SIZE)) * BLOCK_SIZE - draw(st.sampled_from([0, 0, 512, 3584]))
    nblocks = -(-size // BLOCK_SIZE)
    blocks = draw(st.dictionaries(st.integers(0, nblocks - 1), st.none() | st.integers(1, 255).map(
        lambda b: bytes([b]) * BLOCK_SIZE), max_size=8))
    backing = draw(st.none() | st.sampled_from(["base.qcow2", "../layers/" + "a" * 64 + ".qcow2"]))
    return size, backing, blocks


def write(path: Path, layer: tuple[int, str | None, dict[int, bytes | None]]) -> None:
    size, backing, blocks = layer
    records = [(i, blocks[i] is None) for i in sorted(blocks)]
    write_layer(path, virtual_size=size, backing=backing, records=records, read_block=lambda i: blocks[i])


def read_all(path: Path) -> None:
    """Everything a user of the reader does with a layer: its header, its runs, their data."""
    with Qcow2Image(path) as img:
        assert img.block_count == -(-img.virtual_size // BLOCK_SIZE)
        for n, run in enumerate(img.iter_block_runs()):
            assert run.start >= 0 and run.start + run.count <= img.block_count
            assert len(img.read_run(run)) == run.count * BLOCK_SIZE
            if img.block_count:
                img.read_block(run.start)
            if n >= MAX_RUNS:
                break


@fuzz_files
@given(layers())
def test_written_layers_read_back(layer):
    size, backing, blocks = layer
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "layer.qcow2"
        write(path, layer)
        with Qcow2Image(path) as img:
            assert (img.virtual_size, img.backing_file) == (size, backing)
            for i, data in blocks.items():  # the last block's bytes beyond the disk's end read as zeros
                n = min(BLOCK_SIZE, size - i * BLOCK_SIZE)
                assert img.read_block(i) == (data or bytes(BLOCK_SIZE))[:n] + bytes(BLOCK_SIZE - n)
        m = manifest_of_layer(path, None)
        assert [(i, z) for i, z, _ in m.records()] == [(i, blocks[i] is None) for i in sorted(blocks)]


@st.composite
def mutated_layers(draw: st.DrawFn) -> bytes:
    """A written layer with its metadata changed: the header cluster's first 512 bytes mutated, and
    8-byte big-endian table entries (L1, L2, refcount) overwritten with edge values."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "layer.qcow2"
        write(path, draw(layers()))
        data = bytearray(path.read_bytes())
    if draw(st.booleans()):
        data[:512] = draw(mutated(st.just(bytes(data[:512]))))
    for _ in range(draw(st.integers(0, 3))):
        cluster = draw(st.integers(0, max(0, len(data) // CLUSTER - 1)))
        at = cluster * CLUSTER + 8 * draw(st.integers(0, 7))
        value = draw(st.sampled_from(EDGE_INTS) | st.integers(0, 2**64 - 1)
                     | st.integers(0, len(data) // 512).map(lambda c: (1 << 63) | c * 512))
        data[at:at + 8] = struct.pack(">Q", value)
    if draw(st.integers(0, 4)) == 0:
        del data[draw(st.integers(0, len(data))):]
    return bytes(data)


@fuzz_files
@given(mutated_layers() | st.binary(max_size=200).map(lambda b: MAGIC + b))
def test_mutated_layers_read_or_give_image_errors(data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "layer.qcow2"
        path.write_bytes(data)
        with contextlib.suppress(HashcacheError):  # CorruptImageError or UnsupportedImageError
            read_all(path)
