"""Where a running capsule's consoles are: its screen, the VNC server QEMU keeps on a unix socket in its instance
directory (``capsule.runtime.domainxml.add_screen``), and its serial console (a host pty, its output also in the
instance's console log), and what the screen shows now (``screenshot``). Nothing listens on a TCP port; the
agent's console WebSockets (``capsule.console.routes``) are the only way to them from outside this host."""

from __future__ import annotations

import re
import socket
import struct
import xml.etree.ElementTree as ET
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from capsule.capsules import resolve
from capsule.errors import Conflict, RuntimeFailure
from capsule.lifecycle.memimage import VNC_SOCKET
from capsule.names import check_name
from capsule.runtime import guestfiles
from capsule.runtime.connection import lookup_domain
from capsule.store import Store
from capsule.store.catalogue import InstanceRow


@dataclass(frozen=True)
class Serial:
    pty: Path      # the host side of the guest's first serial port
    log: Path      # everything the guest wrote to it since it started on this host


def running_instance(store: Store, name: str, what: str) -> InstanceRow:
    """The instance of the running capsule ``name``: NotFound for an unknown capsule, Conflict when it is not
    running (``what``: what it was wanted for, in the message)."""
    resolve(store, check_name(name))
    inst = store.catalogue.instance(name)
    if inst is None:
        raise Conflict(f"capsule {name!r} is not running, so it has no {what} (`capsule start {name}`)")
    return inst


def _no_screen(name: str) -> Conflict:
    return Conflict(f"capsule {name!r} has no screen: it was restored from a memory image saved without one; "
                    "its next boot (`capsule stop`, then `capsule start`) gives it one")


def vnc_socket(store: Store, name: str) -> Path:
    """The unix socket of the running capsule ``name``'s VNC server. NotFound for an unknown capsule, Conflict
    when it is not running or has no screen (restored from a memory image saved before capsules had one),
    GuestFileRefused when what is there is not a socket of QEMU's (a link, another owner: ``guestfiles``)."""
    inst = running_instance(store, name, "screen")
    sock = Path(inst.dir) / VNC_SOCKET
    try:
        guestfiles.check_socket(sock, f"capsule {name!r}'s screen socket")
    except FileNotFoundError:
        raise _no_screen(name) from None
    return sock


def connect_screen(store: Store, name: str, timeout: float = 5.0) -> socket.socket:
    """A connection to the running capsule ``name``'s VNC server, made through the socket's own node (no link
    followed, its owner checked: ``guestfiles.connect_socket``). Errors as :func:`vnc_socket`; OSError when
    nothing listens there."""
    inst = running_instance(store, name, "screen")
    try:
        return guestfiles.connect_socket(Path(inst.dir) / VNC_SOCKET, f"capsule {name!r}'s screen socket", timeout)
    except FileNotFoundError:
        raise _no_screen(name) from None


def serial_console(store: Store, name: str) -> Serial:
    """The running capsule ``name``'s serial console. NotFound / Conflict as :func:`vnc_socket`."""
    inst = running_instance(store, name, "serial console")
    dom = lookup_domain(inst.domain)
    src = None if dom is None else ET.fromstring(dom.XMLDesc(0)).find("./devices/serial/source")
    path = None if src is None else src.get("path")
    if not path:
        raise Conflict(f"capsule {name!r} has no serial console pty (its domain is gone or has none)")
    return Serial(Path(path), Path(inst.dir) / "console.log")


@dataclass(frozen=True)
class Screenshot:
    """A capsule's screen as libvirt's `virsh screenshot` takes it: RGB, 3 bytes a pixel."""

    width: int
    height: int
    rgb: bytes

    def colours(self) -> Counter[bytes]:
        """How many pixels of each colour (3-byte RGB keys)."""
        return Counter(self.rgb[i : i + 3] for i in range(0, len(self.rgb), 3))


def screenshot(store: Store, name: str) -> Screenshot:
    """The running capsule ``name``'s screen now (`virsh screenshot`: QEMU's screen dump through libvirt, PPM, or
    PNG where QEMU gives that). NotFound / Conflict as :func:`vnc_socket`."""
    inst = running_instance(store, name, "screen")
    dom = lookup_domain(inst.domain)
    if dom is None:
        raise Conflict(f"capsule {name!r} has no screen: its domain is gone")
    stream = dom.connect().newStream(0)
    mime = dom.screenshot(stream, 0)
    chunks: list[bytes] = []
    stream.recvAll(lambda _st, data, acc: acc.append(data), chunks)
    stream.finish()
    data = b"".join(chunks)
    return parse_png(data) if data.startswith(b"\x89PNG") else parse_ppm(data, mime)


def parse_ppm(data: bytes, mime: str = "image/x-portable-pixmap") -> Screenshot:
    """A binary 8-bit PPM (P6)."""
    fields = re.match(rb"P6\s+(?:#[^\n]*\n\s*)*(\d+)\s+(\d+)\s+(\d+)\s", data)
    if fields is None or int(fields[3]) != 255:
        raise RuntimeFailure(f"the screenshot is not an 8-bit PPM ({mime}): {data[:20]!r}")
    w, h = int(fields[1]), int(fields[2])
    return Screenshot(w, h, data[fields.end() : fields.end() + w * h * 3])


def parse_png(data: bytes) -> Screenshot:
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
    if depth != 8 or ctype not in (2, 6):
        raise RuntimeFailure(f"the screenshot is a PNG of depth {depth}, colour type {ctype}: not 8-bit RGB(A)")
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
