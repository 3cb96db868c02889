"""Helpers for tests that drive real guests."""

from __future__ import annotations

import re
import struct
import time
import zlib
from collections import Counter
from dataclasses import dataclass

from capsule.runtime.connection import lookup_domain
from capsule.runtime.console import ConsoleSession
from capsule.store import Store

COUNTER = "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done) >/dev/null 2>&1 &"


def guest(store: Store, capsule: str) -> ConsoleSession:
    return ConsoleSession(store.domain_name(capsule))


def run(store: Store, capsule: str, command: str, timeout: float = 60.0) -> str:
    with guest(store, capsule) as c:
        return c.run(command, timeout=timeout)


def uptime(store: Store, capsule: str) -> float:
    return float(run(store, capsule, "cat /proc/uptime").split()[0])


def count(store: Store, capsule: str) -> int:
    return int(run(store, capsule, "cat /tmp/count"))


def wait_count_above(store: Store, capsule: str, n: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        c = count(store, capsule)
        if c > n or time.monotonic() > deadline:
            return c
        time.sleep(0.3)


def write_blocks(store: Store, capsule: str, seek: int, count: int) -> None:
    """Overwrite ``count`` 4 KiB blocks at block ``seek`` of /dev/vda with random data."""
    run(store, capsule, f"dd if=/dev/urandom of=/dev/vda bs=4096 seek={seek} count={count} "
                        f"conv=notrunc 2>/dev/null; sync")


def disk_digest(store: Store, capsule: str, blocks: int = 2048) -> str:
    """sha256 of the first ``blocks`` 4 KiB blocks of /dev/vda as the guest reads them."""
    out = run(store, capsule, f"echo 3 > /proc/sys/vm/drop_caches; "
                              f"dd if=/dev/vda bs=4096 count={blocks} 2>/dev/null | sha256sum")
    return out.split()[0]


@dataclass(frozen=True)
class Screenshot:
    """A capsule's screen as libvirt's `virsh screenshot` takes it: RGB, 3 bytes a pixel."""

    width: int
    height: int
    rgb: bytes

    def colours(self) -> Counter[bytes]:
        """How many pixels of each colour (3-byte RGB keys)."""
        return Counter(self.rgb[i : i + 3] for i in range(0, len(self.rgb), 3))


def screenshot(store: Store, capsule: str) -> Screenshot:
    """The running capsule's screen now (QEMU's screendump through libvirt: PPM, or PNG where QEMU gives it)."""
    dom = lookup_domain(store.domain_name(capsule))
    assert dom is not None, f"capsule {capsule} is not running"
    stream = dom.connect().newStream(0)
    mime = dom.screenshot(stream, 0)
    chunks: list[bytes] = []
    stream.recvAll(lambda _st, data, acc: acc.append(data), chunks)
    stream.finish()
    data = b"".join(chunks)
    return _png(data) if data.startswith(b"\x89PNG") else _ppm(data, mime)


def _ppm(data: bytes, mime: str) -> Screenshot:
    fields = re.match(rb"P6\s+(?:#[^\n]*\n\s*)*(\d+)\s+(\d+)\s+(\d+)\s", data)
    assert fields is not None and int(fields[3]) == 255, f"not an 8-bit PPM ({mime}): {data[:20]!r}"
    w, h = int(fields[1]), int(fields[2])
    return Screenshot(w, h, data[fields.end() : fields.end() + w * h * 3])


def _png(data: bytes) -> Screenshot:
    """8-bit RGB or RGBA PNG, not interlaced (what QEMU writes)."""
    pos, idat = 8, b""
    w = h = depth = ctype = 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert depth == 8 and ctype in (2, 6), f"PNG of depth {depth}, colour type {ctype}"
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(idat), w * bpp
    prev, rows = bytearray(stride), []
    for y in range(h):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 0xFF
            elif ftype == 2:
                line[i] = (line[i] + b) & 0xFF
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3))
        prev = line
    return Screenshot(w, h, b"".join(rows))
