"""Fuzzing the reader of libvirt's save-image header (capsule/runtime/saveimage.py): a memory image
may come from a peer, so its header and the domain XML in it are bytes from outside. Valid headers
round-trip; hostile ones give IntegrityError (capsule's typed error), nothing else."""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from capsule.errors import IntegrityError
from capsule.runtime.saveimage import MAGIC, identity, read_header
from tests.helpers.fuzzing import MARKS, fuzz, hostile

pytestmark = MARKS

_HEAD = struct.Struct("<16s19I")
xml_text = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters="<>&\"'"),
                   max_size=20)


def domain_xml(name: str, uuid: str) -> bytes:
    return f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid></domain>".encode()  # no markup in them


def save_header(xml: bytes, cookie: bytes, version: int = 2, pad: int = 0) -> bytes:
    data = xml + b"\0" + (cookie + b"\0" if cookie else b"") + bytes(pad)
    cookie_offset = len(xml) + 1 if cookie else 0
    return _HEAD.pack(MAGIC, version, len(data), 1, 0, cookie_offset, *([0] * 14)) + data + b"QEVM"


valid = st.builds(lambda n, u, c, p: save_header(domain_xml(n, u), c, pad=p), xml_text, xml_text,
                  st.binary(max_size=20).map(lambda b: b.replace(b"\0", b"")), st.integers(0, 64))


def read(data: bytes):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "memory.save"
        path.write_bytes(data)
        return read_header(path)


@fuzz
@given(xml_text, xml_text, st.binary(max_size=20).map(lambda b: b.replace(b"\0", b"")))
def test_save_headers_round_trip(name, uuid, cookie):
    h = read(save_header(domain_xml(name, uuid), cookie))
    assert h.cookie == cookie and identity(h.domain_xml, "memory.save") == (name, uuid)


@fuzz
@given(hostile(valid, max_size=300))
@example(save_header(b"<domain><name>x</name", b""))  # was xml.etree's ParseError out of identity()
def test_hostile_save_headers_give_integrity_errors(data):
    try:
        h = read(data)
        identity(h.domain_xml, "memory.save")
    except IntegrityError:
        return
    assert 0 < h.data_len <= 64 << 20 and h.cookie_offset <= h.data_len


def test_domain_xml_that_does_not_parse_is_an_integrity_error():
    """Regression: identity() let xml.etree.ElementTree.ParseError escape (an internal error)."""
    h = read(save_header(b"<domain><name>x</name", b""))
    with pytest.raises(IntegrityError, match="memory.save: its domain XML does not parse"):
        identity(h.domain_xml, "memory.save")


def test_a_huge_data_length_is_refused_before_reading():
    data = _HEAD.pack(MAGIC, 2, 0xFFFF_FFFF, 1, 0, 0, *([0] * 14))
    with pytest.raises(IntegrityError, match="corrupt header"):
        read(data)
