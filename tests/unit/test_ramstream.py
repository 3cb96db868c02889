"""The streaming parser of QEMU's migration stream (capsule/migrate/ramstream.py): it finds the RAM pages in
streams of QEMU 10's format fed in chunks of any size, passes every other byte through, and gives back its input
byte for byte whatever the input is (the real stream of a running guest: tests/vm/test_live_dedup.py)."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capsule.migrate.ramstream import PAGE, RAW, RamStream
from tests.helpers.fuzzing import fuzz, hostile
from tests.helpers.migstream import StreamWriter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def pages(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([(seed + i) % 251 + 1]) * 2048 + os.urandom(2048) for i in range(n)]


def precopy(ps: list[bytes], **kw) -> StreamWriter:
    w = StreamWriter(**kw).config(("x-ignore-shared",) if kw.get("ignore") else ())
    w.ram_start(ignore_shared=False)
    w.ram_part()
    for i, p in enumerate(ps[: len(ps) // 2]):
        w.page(p, offset=i * 4096).zero(offset=(1000 + i) * 4096)
    w.flush().eos()
    w.ram_part(end=True)
    for i, p in enumerate(ps[len(ps) // 2:]):
        w.page(p, block="vga.vram" if i % 3 else "pc.ram", offset=i * 4096)
    w.eos()
    return w.device(3, "cpu", os.urandom(300)).end()


def parse(data: bytes, sizes: list[int]) -> tuple[RamStream, list[tuple[int, bytes]]]:
    p, out, pos, i = RamStream(), [], 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)] if sizes else len(data)
        out += p.feed(data[pos:pos + n])
        pos, i = pos + n, i + 1
    return p, out + p.close()


@pytest.mark.parametrize("sizes", [[], [1], [7, 4099], [65536], [3, 5000, 1, 13]])
def test_pages_are_found_and_the_stream_comes_back_byte_for_byte(sizes):
    ps = pages(12)
    w = precopy(ps)
    p, out = parse(w.bytes(), sizes)
    assert b"".join(d for _, d in out) == w.bytes()
    assert [d for k, d in out if k == PAGE] == w.pages
    assert p.counts.pages == 12 and p.counts.zero_pages == 6 and p.counts.sections == 3
    assert p.counts.blocks == [("pc.ram", 1 << 24), ("vga.vram", 1 << 20)]
    assert p.counts.reason == "device state"        # parsing stops at the device state, the rest passes as is


def test_a_packaged_command_passes_whole_and_parsing_goes_on_after_it():
    ps = pages(4)
    w = StreamWriter().config().ram_start().ram_part().page(ps[0]).eos()
    inner = StreamWriter(footers=True).device(5, "pci", os.urandom(100)).bytes()[8:]
    w.command(3, b"\0" * 16).packaged(inner + ps[1])       # a page-looking run inside the package is left alone
    w.ram_part().page(ps[2]).page(ps[3], offset=4096).eos().end()
    p, out = parse(w.bytes(), [100])
    assert b"".join(d for _, d in out) == w.bytes()
    assert [d for k, d in out if k == PAGE] == [ps[0], ps[2], ps[3]]


def test_without_footers_and_with_ignore_shared_addresses():
    ps = pages(3)
    w = StreamWriter(footers=False).config(("x-ignore-shared",)).ram_start(ignore_shared=True)
    w.ram_part()
    for p_ in ps:
        w.page(p_)
    w.eos().end()
    p, out = parse(w.bytes(), [333])
    assert [d for k, d in out if k == PAGE] == ps
    assert b"".join(d for _, d in out) == w.bytes()


@pytest.mark.parametrize("bad", [
    struct.pack(">Q", 0x40) + b"\x03ram" + b"\x01" + b"\0\x10" + bytes(16),       # XBZRLE: not parsed
    struct.pack(">Q", 0x80),                                                    # an RDMA hook
    struct.pack(">Q", 0x0C),                                                    # two flags at once
])
def test_what_it_does_not_know_passes_through_from_there_on(bad):
    ps = pages(2)
    w = StreamWriter().config().ram_start().ram_part().page(ps[0]).raw(bad)
    w.page(ps[1]).eos().end()
    p, out = parse(w.bytes(), [64])
    assert b"".join(d for _, d in out) == w.bytes()
    assert [d for k, d in out if k == PAGE] == [ps[0]]
    assert p.passthrough and p.counts.reason


def test_a_stream_without_the_header_is_passed_through():
    data = os.urandom(10000)
    p, out = parse(data, [10])
    assert out and all(k == RAW for k, _ in out) and b"".join(d for _, d in out) == data
    assert p.passthrough


@fuzz
@given(hostile(st.just(precopy(pages(3, 7)).bytes()), max_size=2048), st.lists(st.integers(1, 9000), max_size=6))
def test_fuzz_any_bytes_come_back_exactly(data, sizes):
    p, out = parse(data, sizes)
    assert b"".join(d for _, d in out) == data
    assert all(len(d) == 4096 for k, d in out if k == PAGE)


@pytest.mark.parametrize("sizes", [[], [1], [7, 4099], [3, 5000, 1, 13]])
def test_the_switchover_and_the_device_state_are_found_where_they_begin(sizes):
    ps = pages(6)
    w = StreamWriter().config().ram_start().ram_part()
    w.page(ps[0]).page(ps[1], offset=4096).eos()
    end_at = len(w.bytes())
    w.ram_part(end=True).page(ps[2]).page(ps[3], offset=8192).eos()
    device_at = len(w.bytes())
    w.device(3, "cpu", os.urandom(300)).end()
    p, out = parse(w.bytes(), sizes)
    assert (p.counts.end_at, p.counts.device_at) == (end_at, device_at)
    assert b"".join(d for _, d in out) == w.bytes()


def test_a_post_copy_stream_has_no_switchover_at_its_end():
    ps = pages(3)
    w = StreamWriter().config().ram_start().ram_part().page(ps[0]).eos()
    w.packaged(StreamWriter(footers=True).device(5, "pci", os.urandom(100)).bytes()[8:])
    w.ram_part(end=True).page(ps[1]).page(ps[2], offset=4096).eos().end()
    p, _ = parse(w.bytes(), [100])
    assert p.counts.end_at is None          # the guest ran at the other host long before this END
