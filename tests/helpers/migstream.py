"""Synthetic QEMU migration streams in QEMU 10's format (what :mod:`capsule.migrate.ramstream` parses), for
unit tests: a header, the configuration, ram sections of pages and zero pages, commands, device state."""

from __future__ import annotations

import os
import struct

from capsule.migrate import ramstream as rs


def name(s: str) -> bytes:
    return bytes([len(s)]) + s.encode()


class StreamWriter:
    def __init__(self, blocks: tuple[tuple[str, int], ...] = (("pc.ram", 1 << 24), ("vga.vram", 1 << 20)),
                 footers: bool = True) -> None:
        self.out = bytearray(struct.pack(">II", rs.MAGIC, rs.VERSION))
        self.blocks, self.footers = blocks, footers
        self.pages: list[bytes] = []
        self._last: str | None = None

    def config(self, caps: tuple[str, ...] = ()) -> StreamWriter:
        self.out += bytes([rs.CONFIGURATION]) + struct.pack(">I", 6) + b"pc-q35"
        self.out += bytes([rs.SUBSECTION]) + name("configuration/target-page-bits") + struct.pack(">II", 1, 12)
        if caps:
            self.out += bytes([rs.SUBSECTION]) + name("configuration/capabilities") + struct.pack(">II", 1, len(caps))
            for c in caps:
                self.out += name(c)
        self.out += bytes([rs.SUBSECTION]) + name("configuration/uuid") + struct.pack(">I", 1) + bytes(range(16))
        return self

    def ram_start(self, sid: int = 2, ignore_shared: bool = False) -> StreamWriter:
        self.out += bytes([rs.START]) + struct.pack(">I", sid) + name("ram") + struct.pack(">II", 0, 4)
        total = sum(length for _, length in self.blocks)
        self.out += struct.pack(">Q", total | rs.F_MEM_SIZE)
        for block, length in self.blocks:
            self.out += name(block) + struct.pack(">Q", length)
            if ignore_shared:
                self.out += struct.pack(">Q", 0xFEE00000)
        self._last = None
        return self.eos(sid)

    def ram_part(self, sid: int = 2, end: bool = False) -> StreamWriter:
        self.out += bytes([rs.END if end else rs.PART]) + struct.pack(">I", sid)
        self._last = None
        return self

    def _head(self, block: str, offset: int, flag: int) -> None:
        if block == self._last:
            self.out += struct.pack(">Q", offset | flag | rs.F_CONTINUE)
        else:
            self.out += struct.pack(">Q", offset | flag) + name(block)
            self._last = block

    def page(self, data: bytes, block: str = "pc.ram", offset: int = 0) -> StreamWriter:
        assert len(data) == rs.PAGE_SIZE
        self._head(block, offset, rs.F_PAGE)
        self.out += data
        self.pages.append(data)
        return self

    def zero(self, block: str = "pc.ram", offset: int = 0) -> StreamWriter:
        self._head(block, offset, rs.F_ZERO)
        self.out += b"\0"
        return self

    def flush(self) -> StreamWriter:
        self.out += struct.pack(">Q", rs.F_MULTIFD_FLUSH)
        return self

    def eos(self, sid: int = 2) -> StreamWriter:
        self.out += struct.pack(">Q", rs.F_EOS)
        if self.footers:
            self.out += bytes([rs.FOOTER]) + struct.pack(">I", sid)
        return self

    def command(self, cmd: int, data: bytes = b"") -> StreamWriter:
        self.out += bytes([rs.COMMAND]) + struct.pack(">HH", cmd, len(data)) + data
        return self

    def packaged(self, inner: bytes) -> StreamWriter:
        return self.command(rs.CMD_PACKAGED, struct.pack(">I", len(inner))).raw(inner)

    def device(self, sid: int, idstr: str, state: bytes) -> StreamWriter:
        self.out += bytes([rs.FULL]) + struct.pack(">I", sid) + name(idstr) + struct.pack(">II", 0, 1) + state
        if self.footers:
            self.out += bytes([rs.FOOTER]) + struct.pack(">I", sid)
        return self

    def raw(self, data: bytes) -> StreamWriter:
        self.out += data
        return self

    def end(self) -> StreamWriter:
        self.out += bytes([rs.EOF, rs.VMDESC]) + struct.pack(">I", 2) + b"{}"
        return self

    def bytes(self) -> bytes:
        return bytes(self.out)


def guest_order(pages: list[bytes], gap_at: int = -1) -> bytes:
    """A stream whose pages are at consecutive guest addresses, as a round sends them (a zero page at
    ``gap_at``'s place), then the device state."""
    w = StreamWriter().config().ram_start().ram_part()
    for i, p in enumerate(pages):
        if i == gap_at:
            w.zero(offset=i * 4096)
        else:
            w.page(p, offset=i * 4096)
    w.eos().ram_part(end=True).eos()
    return w.device(3, "cpu", os.urandom(500)).end().bytes()
