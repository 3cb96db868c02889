"""Screenshots as libvirt hands them over: PPM (QEMU's screen dump) and PNG, every PNG row filter."""

from __future__ import annotations

import struct
import zlib

import pytest

from capsule.console.screen import Screenshot, parse_png, parse_ppm
from capsule.errors import RuntimeFailure

pytestmark = pytest.mark.unit

W, H = 7, 5
RGB = bytes((x * 37 + y * 11 + c * 5) & 0xFF for y in range(H) for x in range(W) for c in range(3))


def _filter(kind: int, line: bytes, prev: bytes, bpp: int) -> bytes:
    out = bytearray()
    for i, v in enumerate(line):
        a = line[i - bpp] if i >= bpp else 0
        b, c = prev[i], prev[i - bpp] if i >= bpp else 0
        if kind == 0:
            pred = 0
        elif kind == 1:
            pred = a
        elif kind == 2:
            pred = b
        elif kind == 3:
            pred = (a + b) // 2
        else:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
        out.append((v - pred) & 0xFF)
    return bytes(out)


def _png(rgb: bytes, alpha: bool) -> bytes:
    bpp = 4 if alpha else 3
    pixels = b"".join(rgb[i : i + 3] + (b"\x80" if alpha else b"") for i in range(0, len(rgb), 3))
    stride, prev, raw = W * bpp, bytes(W * bpp), b""
    for y in range(H):
        line = pixels[y * stride : (y + 1) * stride]
        kind = y % 5  # every filter type, one per row
        raw += bytes([kind]) + _filter(kind, line, prev, bpp)
        prev = line

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", W, H, 8, 6 if alpha else 2, 0, 0, 0)
    half = zlib.compress(raw)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", half[:10]) + chunk(b"IDAT", half[10:])
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("alpha", [False, True])
def test_png_every_filter_decodes_to_the_pixels(alpha: bool) -> None:
    assert parse_png(_png(RGB, alpha)) == Screenshot(W, H, RGB)


def test_ppm_with_a_comment() -> None:
    shot = parse_ppm(b"P6\n# QEMU screendump\n%d %d\n255\n" % (W, H) + RGB)
    assert shot == Screenshot(W, H, RGB)
    assert shot.colours()[RGB[:3]] >= 1 and sum(shot.colours().values()) == W * H


def test_not_a_picture_is_refused() -> None:
    with pytest.raises(RuntimeFailure, match="not an 8-bit PPM"):
        parse_ppm(b"P3\n1 1\n255\n0 0 0\n")
    with pytest.raises(RuntimeFailure, match="depth 16"):
        parse_png(b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">IIBBBBB", 1, 1, 16, 2, 0, 0, 0)
                  + b"\0\0\0\0")
