"""Pages as deltas against a similar block both hosts hold (capsule/migrate/memdelta.py, ramdedup's OP_DELTA): a
relocated kernel page finds its block and travels as a few hundred bytes, the destination rebuilds it exactly
from the block it reads, and a wrong block, a corrupt delta or one that would make more than a page fails with
the typed error and bounded memory."""

from __future__ import annotations

import os
import random
import struct

import pytest
import zstandard

from capsule.errors import IntegrityError
from capsule.migrate import memdelta, ramdedup
from capsule.migrate.memdelta import Similar, delta, undelta
from capsule.migrate.memknown import Known
from capsule.migrate.ramdedup import Decoder, Encoder
from hashcache.blocks import hash_block
from tests.helpers.fuzzing import peak_allocation
from tests.helpers.migstream import guest_order

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def code_like(n: int, seed: int = 1) -> bytes:
    """Pages that look like machine code: varied bytes, some repeats, no padding."""
    r = random.Random(seed)
    ops = [bytes(r.randrange(256) for _ in range(r.randint(2, 7))) for _ in range(600)]
    out = bytearray()
    while len(out) < n * 4096:
        out += r.choice(ops)
    return bytes(out[:n * 4096])


def relocated(page: bytes, seed: int, every: int = 200) -> bytes:
    """``page`` with a 4-byte field changed every ``every`` bytes, as KASLR's relocations change code."""
    r, out = random.Random(seed), bytearray(page)
    for at in range(r.randrange(every), 4096 - 4, every):
        out[at:at + 4] = struct.pack("<I", (struct.unpack_from("<I", out, at)[0] + 0x2A00000) & 0xFFFF_FFFF)
    return bytes(out)


class Blocks:
    """The destination's side: blocks of the numbered objects, as memrefs.StoreResolver gives them."""

    def __init__(self, objects: dict[int, bytes]) -> None:
        self.objects = objects

    def __call__(self, h: bytes) -> bytes | None:
        return None

    def blocks(self, obj: int, first: int, count: int) -> list[bytes]:
        if obj not in self.objects or (first + count) * 4096 > len(self.objects[obj]):
            raise IntegrityError(f"no blocks {first}.. of object {obj}")
        return [self.objects[obj][b * 4096:(b + 1) * 4096] for b in range(first, first + count)]


def test_a_delta_against_its_block_makes_the_page_again():
    ref = code_like(1)
    page = relocated(ref, 1)
    d = delta(page, ref)
    assert len(d) < 700 and undelta(d, ref) == page


def test_a_delta_against_another_block_or_corrupt_fails_with_the_typed_error():
    ref, other = code_like(1, 1), code_like(1, 2)
    d = delta(relocated(ref, 1), ref)
    with pytest.raises(IntegrityError):
        undelta(d, other)                               # the checksum of the page it makes differs
    bad = bytearray(d)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(IntegrityError):
        undelta(bytes(bad), ref)
    with pytest.raises(IntegrityError):
        undelta(d[:-6], ref)


def test_a_delta_that_says_it_makes_more_than_a_page_is_refused_before_it_is_made():
    bomb = zstandard.ZstdCompressor().compress(bytes(512 << 20))          # says: 512 MiB
    with pytest.raises(IntegrityError, match="more than a page"):
        undelta(bomb, code_like(1))
    assert peak_allocation(lambda: undelta(bomb, code_like(1))) < 4 << 20
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(8192))
    with pytest.raises(IntegrityError):
        undelta(unsized, code_like(1))


def test_similar_finds_the_block_a_relocated_page_came_from_and_nothing_for_padding():
    image = code_like(64)
    similar = Similar()
    similar.add(3, image)
    for b in (0, 17, 63):
        assert similar.find(relocated(image[b * 4096:(b + 1) * 4096], b)) == (3, b)
    assert similar.find(bytes(4096)) is None and similar.find(b"\xcc" * 4096) is None
    assert similar.find(os.urandom(4096)) is None
    assert similar.delta_of(os.urandom(4096)) is None


def test_pages_like_a_held_block_go_as_deltas_only_to_a_peer_that_decodes_them():
    image = code_like(40)
    known = Known()
    known.similar = Similar()
    known.similar.add(0, image)
    guest = [relocated(image[b * 4096:(b + 1) * 4096], b) for b in range(40)] + [os.urandom(4096)]
    data = guest_order(guest)
    sizes = {}
    for peer_decodes in (False, True):
        enc = Encoder(known, runs=True, delta=peer_decodes)
        frames = enc.encode(data) + enc.finish()
        sizes[peer_decodes] = len(frames)
        dec = Decoder(Blocks({0: image}))
        assert dec.decode(frames) == data
        dec.finish()
        assert (enc.stats.deltas, dec.stats.deltas) == ((40, 40) if peer_decodes else (0, 0))
        assert enc.stats.raw_pages == (1 if peer_decodes else 41)
    assert sizes[True] < sizes[False] / 2, sizes


def _one_delta_frame(obj: int, block: int, d: bytes, cut: int = 0) -> bytes:
    ops = struct.pack(">BHIH", ramdedup.OP_DELTA, obj, block, len(d)) + d
    ops = ops[:len(ops) - cut]
    return struct.pack(">cIII", b"B", len(ops), 0, 0) + ops


def test_a_hostile_delta_op_fails_with_the_typed_error():
    image = code_like(4)
    d = delta(relocated(image[:4096], 0), image[:4096])
    good = _one_delta_frame(0, 0, d)
    assert hash_block(Decoder(Blocks({0: image})).decode(good)) == hash_block(relocated(image[:4096], 0))
    for frame in (_one_delta_frame(7, 0, d),            # an object the move does not name
                  _one_delta_frame(0, 99, d),           # a block it does not have
                  _one_delta_frame(0, 1, d),            # another block: the checksum differs
                  _one_delta_frame(0, 0, d, cut=3)):    # the op cut short
        with pytest.raises(IntegrityError):
            Decoder(Blocks({0: image})).decode(frame)
    with pytest.raises(IntegrityError, match="does not resolve"):
        Decoder(lambda h: None).decode(good)             # an end without places cannot take deltas


def test_the_agent_names_the_feature():
    from capsule.agent.protocol import FEATURES
    assert memdelta.FEATURE in FEATURES
