"""The memory codec of a live move (capsule/migrate/ramdedup.py): encoder → decoder is byte-exact, pages the
destination holds travel as references and are checked there, and hostile framing gives the typed error with
bounded memory (a real guest's stream through it: tests/vm/test_live_dedup.py)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capsule.errors import IntegrityError
from capsule.migrate import ramdedup
from capsule.migrate.ramdedup import Decoder, Encoder, Known
from hashcache.blocks import hash_block
from hashcache.manifest import manifest_of_file
from tests.helpers.fuzzing import fuzz, hostile, peak_allocation
from tests.helpers.migstream import StreamWriter, guest_order

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def stream(held: list[bytes], fresh: list[bytes], repeat: int = 0) -> bytes:
    w = StreamWriter().config().ram_start().ram_part()
    for i, p in enumerate(held + fresh):
        w.page(p, offset=i * 4096).zero(offset=(5000 + i) * 4096)
    w.eos().ram_part()
    for i, p in enumerate(fresh[:repeat]):           # a later round resends pages (dirty again, same content)
        w.page(p, offset=(9000 + i) * 4096)
    w.eos().ram_part(end=True).eos()
    return w.device(3, "cpu", os.urandom(500)).end().bytes()


def through(data: bytes, known: Known, store: dict[bytes, bytes], chunk: int = 65536) -> tuple[bytes, Encoder,
                                                                                             Decoder]:
    enc, dec = Encoder(known), Decoder(store.get)
    wire = [enc.encode(data[i:i + chunk]) for i in range(0, len(data), chunk)] + [enc.finish()]
    out = b"".join(dec.decode(w) for w in wire)
    dec.finish()
    return out, enc, dec


def known_of(pages: list[bytes]) -> tuple[Known, dict[bytes, bytes]]:
    store = {hash_block(p): p for p in pages}
    return Known(int.from_bytes(h[:8], "little") for h in store), store


def test_pages_the_destination_holds_travel_as_references_and_the_stream_is_rebuilt_exactly():
    held = [os.urandom(4096) for _ in range(40)]
    fresh = [os.urandom(4096) for _ in range(20)]
    data = stream(held, fresh, repeat=5)
    known, store = known_of(held)
    for chunk in (1, 4097, 65536, len(data)):
        if chunk == 1:
            data_ = data[:30000]                       # (byte by byte: a prefix, for time)
            out, enc, dec = through(data_, known, store, chunk)
            assert out == data_
            continue
        out, enc, dec = through(data, known, store, chunk)
        assert out == data
        assert (enc.stats.refs, enc.stats.recent, enc.stats.raw_pages) == (40, 5, 20)
        assert (dec.stats.refs, dec.stats.recent, dec.stats.raw_pages) == (40, 5, 20)
        # 40 held pages cost 33 bytes each, 20 random ones their size: far below the raw stream
        assert enc.stats.wire_bytes < 20 * 4096 + 40 * 40 + 4000 < len(data) // 2
        assert dec.stats.stream_bytes == len(data) == enc.stats.stream_bytes
        # what the switchover can count on: the stream less its 45 pages that went as references
        assert enc.stats.literal_bytes == len(data) - 45 * 4096


def test_compressible_pages_are_compressed():
    fresh = [bytes([i]) * 4096 for i in range(1, 50)]
    data = stream([], fresh)
    out, enc, _ = through(data, Known(), {})
    assert out == data and enc.stats.wire_bytes < len(data) // 20


def test_a_page_like_one_sent_in_an_earlier_call_costs_little_one_zstd_stream_spans_the_connection():
    base = os.urandom(4096)
    again = base[:4000] + os.urandom(96)               # not equal (no "recent" op), but nearly: zstd matches it
    w = StreamWriter().config().ram_start().ram_part().page(base, offset=0)
    cut = len(w.out)                                   # the first call ends after the first page
    data = w.page(again, offset=4096).eos().bytes()
    enc, dec = Encoder(), Decoder({}.get)
    one, two = enc.encode(data[:cut]), enc.encode(data[cut:])
    assert len(one) > 4096 and len(two) < 600, (len(one), len(two))
    assert dec.decode(one) + dec.decode(two) == data


def test_a_small_frame_that_expands_past_its_batch_is_refused_without_the_memory():
    import zstandard

    z = zstandard.ZstdCompressor().compressobj()
    bomb = z.compress(bytes(64 << 20)) + z.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)    # 64 MiB of zeros
    head = ramdedup._HEAD.pack(ramdedup.BATCH, 1, len(bomb), 4096)
    assert len(bomb) < 4096 + 64 + 1024          # within what the batch header may declare
    with pytest.raises(IntegrityError, match="beyond the 4096 bytes its frame says"):
        Decoder({}.get).decode(head + bytes([ramdedup.OP_PAGE]) + bomb)
    # what it holds: zstd's output buffer (a batch's payload and a block) and one copy of it, not 64 MiB
    peak = peak_allocation(lambda: Decoder({}.get).decode(head + bytes([ramdedup.OP_PAGE]) + bomb))
    assert peak < 2 * ramdedup.MAX_PAYLOAD + (1 << 20), peak


def test_a_reference_whose_bytes_fail_blake3_is_refused_naming_the_hash():
    held = [os.urandom(4096) for _ in range(3)]
    known, store = known_of(held)
    h = hash_block(held[1])
    store[h] = os.urandom(4096)                        # what this host read for it is something else
    with pytest.raises(IntegrityError, match=h.hex()):
        through(stream(held, []), known, store)


def test_a_reference_the_destination_cannot_resolve_fails_the_stream():
    held = [os.urandom(4096) for _ in range(3)]
    known, store = known_of(held)
    del store[hash_block(held[2])]
    with pytest.raises(IntegrityError, match=f"{hash_block(held[2]).hex()}.*does not hold"):
        through(stream(held, []), known, store)


def test_known_of_manifests_answers_the_blocks_of_the_objects(tmp_path):
    blocks = [os.urandom(4096) for _ in range(10)]
    f = tmp_path / "obj"
    f.write_bytes(b"".join(blocks[:5]) + bytes(8192) + b"".join(blocks[5:]))
    known = Known.of_manifests([manifest_of_file(f)])
    assert len(known) == 10 and known.nbytes == 160           # a prefix and a place each
    assert all(hash_block(b) in known for b in blocks)
    assert hash_block(os.urandom(4096)) not in known and hash_block(bytes(4096)) not in known
    # where each block is: object 0, its block index (the zero blocks 5 and 6 are holes, not listed)
    assert [known.place(hash_block(b)) for b in blocks] == [(0, i) for i in (0, 1, 2, 3, 4, 7, 8, 9, 10, 11)]
    assert known.place(hash_block(os.urandom(4096))) is None


class Objects:
    """The destination's side of runs, as memrefs.StoreResolver does it: blocks of numbered objects, each checked
    against the object's manifest (the objects: files of this test's directory)."""

    def __init__(self, files: list) -> None:
        self.files = files
        self.manifests = [manifest_of_file(f) for f in files]

    def __call__(self, h: bytes) -> bytes | None:
        return None

    def blocks(self, obj: int, first: int, count: int) -> list[bytes]:
        if not 0 <= obj < len(self.files):
            raise IntegrityError(f"object {obj}")
        data = self.files[obj].read_bytes()
        pages = [data[b * 4096:(b + 1) * 4096] for b in range(first, first + count)]
        for b, page in zip(range(first, first + count), pages, strict=True):
            if self.manifests[obj].hash_of(b) != hash_block(page):
                raise IntegrityError(f"block {b} of object {obj} does not match its manifest")
        return pages


def _image(tmp_path, name: str, pages: list[bytes]):
    f = tmp_path / name
    f.write_bytes(b"".join(pages))
    return f


def test_held_pages_at_the_same_place_go_as_runs_of_blocks_and_come_back_exactly(tmp_path):
    yesterday = [os.urandom(4096) for _ in range(300)]
    today = list(yesterday)
    for i in (50, 51, 200):                            # three pages changed since: literal
        today[i] = os.urandom(4096)
    other = [os.urandom(4096) for _ in range(4)]       # a page cached from a layer, out of order
    today[120] = other[2]
    files = [_image(tmp_path, "layer", other), _image(tmp_path, "yesterday", yesterday)]
    known = Known.of_manifests(manifest_of_file(f) for f in files)
    data = guest_order(today, gap_at=260)              # a page now zero: the run goes on past it? no: it ends
    wire = {}
    for runs in (False, True):
        enc, dec = Encoder(known, runs=runs), Decoder(Objects(files))
        frames = enc.encode(data) + enc.finish()
        wire[runs] = len(frames)
        if runs:
            assert dec.decode(frames) == data
            dec.finish()
            assert (dec.stats.refs, dec.stats.raw_pages) == (296, 3)
    assert (enc.stats.refs, enc.stats.raw_pages) == (296, 3)
    # runs: 0-49, 52-119, 120 (the layer's block), 121-199, 201-259, 261-299: 6 runs of 19 bytes for 296 pages,
    # where each page took an 8-byte header (a raw op of 5 bytes) and a 33-byte reference
    assert enc.stats.runs == 6
    assert wire[False] - wire[True] > 296 * (33 + 5) - 6 * 19 - 200, wire
    assert wire[True] < 3 * 4096 + 6 * (19 + 5 + 8) + 2000, wire


def test_runs_to_a_peer_without_places_fall_back_to_hashes():
    held = [os.urandom(4096) for _ in range(10)]
    known, store = known_of(held)                      # prefixes only: no places
    enc, data = Encoder(known, runs=True), stream(held, [])
    frames = enc.encode(data) + enc.finish()
    assert enc.stats.refs == 10 and enc.stats.runs == 0
    assert Decoder(store.get).decode(frames) == data


def test_a_run_whose_block_differs_here_is_refused_naming_it(tmp_path):
    pages = [os.urandom(4096) for _ in range(8)]
    f = _image(tmp_path, "img", pages)
    known = Known.of_manifests([manifest_of_file(f)])
    enc = Encoder(known, runs=True)
    frames = enc.encode(guest_order(pages)) + enc.finish()
    objects = Objects([f])
    f.write_bytes(b"".join(pages[:3]) + os.urandom(4096) + b"".join(pages[4:]))   # block 3 changed here
    with pytest.raises(IntegrityError, match="block 3 of object 0"):
        Decoder(objects).decode(frames)
    with pytest.raises(IntegrityError, match="does not resolve"):
        Decoder({}.get).decode(frames)                 # an end that resolves no places


@pytest.mark.parametrize("run", [
    ramdedup._RUN.pack(ramdedup.OP_BLOCKS, 0, 0, 0, 0),               # a run of nothing
    ramdedup._RUN.pack(ramdedup.OP_BLOCKS, 0, 0, 0xFFFF_FFFF, 0x28),  # more pages than a batch makes
    ramdedup._RUN.pack(ramdedup.OP_BLOCKS, 0, 0, 2, 0),               # pages without their headers
    ramdedup._RUN.pack(ramdedup.OP_BLOCKS, 0, 0, 3, (1 << 64) - 4096 | 0x28),   # headers past 2⁶⁴
    ramdedup._RUN.pack(ramdedup.OP_BLOCKS, 7, 0, 1, 0),               # an object never named
    ramdedup._RUN.pack(ramdedup.OP_BLOCKS, 0, 1 << 30, 1, 0),         # beyond the object
    ramdedup._RUN.pack(ramdedup.OP_BLOCKS, 0, 0, 1, 0)[:7],           # cut
])
def test_hostile_runs_are_refused_without_reading_much(tmp_path, run):
    f = _image(tmp_path, "img", [os.urandom(4096) for _ in range(4)])
    frame = ramdedup._HEAD.pack(ramdedup.BATCH, len(run), 0, 0) + run
    peak = peak_allocation(lambda: pytest.raises(IntegrityError, Decoder(Objects([f])).decode, frame))
    assert peak < 4 << 20


def _valid_wire() -> bytes:
    held = [bytes([7]) * 4096, os.urandom(4096)]
    known, _ = known_of(held[:1])
    enc = Encoder(known)
    return enc.encode(stream(held, [bytes([9]) * 4096], repeat=1)) + enc.finish()


VALID = _valid_wire()


@fuzz
@given(hostile(st.just(VALID), max_size=4096), st.integers(1, 5000))
def test_fuzz_hostile_framing_gives_the_typed_error(wire, chunk):
    known = {hash_block(bytes([7]) * 4096): bytes([7]) * 4096}
    dec = Decoder(known.get)
    try:
        for i in range(0, len(wire), chunk):
            dec.decode(wire[i:i + chunk])
        dec.finish()
    except IntegrityError:
        pass


@pytest.mark.parametrize("head", [
    ramdedup._HEAD.pack(b"B", 0xFFFF_FFFF, 0, 0),                  # huge ops
    ramdedup._HEAD.pack(b"B", 0, 0xFFFF_FFFF, 0xFFFF_FFFF),        # a huge payload
    ramdedup._HEAD.pack(b"B", 5, 0, 0) + bytes([1]) + (1 << 31).to_bytes(4, "big"),   # a raw run of 2 GiB
    ramdedup._HEAD.pack(b"B", 1, 0, 0) + bytes([9]),               # an unknown op
    ramdedup._HEAD.pack(b"B", 5, 0, 0) + bytes([4]) + (0).to_bytes(4, "big"),          # a page never sent
    ramdedup._HEAD.pack(b"X", 0, 0, 0),
])
def test_huge_lengths_and_bad_ops_are_refused_without_buffering(head):
    dec = Decoder({}.get)
    peak = peak_allocation(lambda: dec.decode(head + bytes(1 << 16)))
    with pytest.raises(IntegrityError):
        Decoder({}.get).decode(head + bytes(1 << 16))
    assert peak < 4 << 20


def test_a_truncated_stream_is_an_error_at_its_end():
    dec = Decoder({}.get)
    dec.decode(VALID[:-10])
    with pytest.raises(IntegrityError, match="ended inside a frame"):
        dec.finish()


YESTERDAY = [bytes([i]) * 2048 + os.urandom(2048) for i in range(1, 41)]


@fuzz
@given(st.lists(st.tuples(st.integers(-3, 39), st.integers(0, 2)), max_size=120), st.integers(1, 70000))
def test_fuzz_runs_come_back_exactly_however_pages_and_reads_fall(tmp_path_factory, picks, chunk):
    """Pages of yesterday's image (by place), new pages, zero pages and repeats, at addresses in order or not,
    cut into reads of any size: the stream comes back byte for byte."""
    d = tmp_path_factory.mktemp("img")
    f = _image(d, "yesterday", YESTERDAY)
    known = Known.of_manifests([manifest_of_file(f)])
    w = StreamWriter().config().ram_start().ram_part()
    for i, (pick, step) in enumerate(picks):
        offset = (i + step) * 4096                        # mostly consecutive, sometimes a gap or the same place
        if pick == -3:
            w.zero(offset=offset)
        elif pick < 0:
            w.page(os.urandom(4096) if pick == -1 else YESTERDAY[0], offset=offset)
        else:
            w.page(YESTERDAY[pick], offset=offset)
    data = w.eos().ram_part(end=True).eos().device(3, "cpu", b"state").end().bytes()
    enc, dec = Encoder(known, runs=True), Decoder(Objects([f]))
    out = b"".join(dec.decode(enc.encode(data[i:i + chunk])) for i in range(0, len(data), chunk))
    out += dec.decode(enc.finish())
    dec.finish()
    assert out == data
    assert dec.stats.refs == enc.stats.refs and dec.stats.runs == enc.stats.runs
