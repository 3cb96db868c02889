"""A streaming parser of QEMU's migration stream (QEMU 10, precopy, and postcopy's packaged device state) that
finds the RAM pages in it and passes every other byte through as it came.

:class:`RamStream` is fed the stream in chunks of any size and answers, for each chunk, what it found:
``(RAW, bytes)`` runs and ``(PAGE, bytes)`` pages (the 4096 bytes of one RAM page record; its header is in the
raw run before it). Joined in order, the answers are the input, byte for byte, always — whatever the input is.
The parser only decides which 4 KiB runs are pages; a codec that keeps those runs exact (:mod:`ramdedup`) can
therefore never change what QEMU receives, even on a stream this parser misreads.

The format, as QEMU 10 writes it (``migration/savevm.c``, ``migration/ram.c``)::

    be32 0x5145564d "QEVM", be32 3
    sections, each: u8 type
      0x07 CONFIGURATION  be32 len + machine name, then subsections (0x05 u8 len + name, be32 version, fields)
      0x01 START / 0x04 FULL  be32 section id, u8 len + idstr, be32 instance id, be32 version id, state
      0x02 PART / 0x03 END    be32 section id, state
      0x08 COMMAND  be16 cmd, be16 len, data (cmd 7 PACKAGED: be32 length, then that many bytes: a stream)
      0x00 EOF (then maybe 0x06 VMDESC: be32 len + JSON)
      each START/PART/END/FULL section ends with the footer 0x7e + be32 section id (when the machine sends it)
    the state of the "ram" section: records be64 (offset | flags)
      MEM_SIZE 0x04: the total, then per RAM block u8 len + idstr, be64 length (+ be64 address with the
                     x-ignore-shared capability; + be64 page size with postcopy and huge pages: not parsed)
      ZERO 0x02 (+ u8 fill), PAGE 0x08 (+ 4096 bytes), each preceded by u8 len + block idstr unless CONTINUE
      0x20 is set; EOS 0x10 ends the section's state; MULTIFD_FLUSH 0x200 stands alone

A device's state (FULL, or the START/PART of any section but "ram") carries no length, so the parser cannot
skip it: from there on, everything is passed through (device state is small and comes last in precopy). So is
everything after something it does not know (XBZRLE, RDMA hooks, huge-page blocks, mapped-ram, ...). A PACKAGED
command (postcopy's device state) is passed through whole, by its length, and parsing goes on after it."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

RAW, PAGE = 0, 1
PAGE_SIZE = 4096
MAGIC, VERSION = 0x5145564D, 3
EOF, START, PART, END, FULL, SUBSECTION, VMDESC, CONFIGURATION, COMMAND, FOOTER = 0, 1, 2, 3, 4, 5, 6, 7, 8, 0x7E
F_ZERO, F_MEM_SIZE, F_PAGE, F_EOS, F_CONTINUE, F_MULTIFD_FLUSH = 0x02, 0x04, 0x08, 0x10, 0x20, 0x200
FLAGS_MASK = 0xFFF                     # the flags are the low bits of a page-aligned offset
CMD_PACKAGED = 7
DEVICE_STATE = "device state"          # why parsing stops at a FULL section
MAX_BLOCKS = 256                       # RAM blocks announced by MEM_SIZE before it is called nonsense
MAX_CAPABILITIES = 64

Item = tuple[int, bytes]


class _Short(Exception):
    """Not enough bytes buffered for the unit being parsed: wait for the next chunk."""


class _Unknown(Exception):
    """Something the parser does not know: everything from the unit's start on is passed through."""


@dataclass
class Counts:
    pages: int = 0                     # PAGE records found
    zero_pages: int = 0                # ZERO records found
    sections: int = 0                  # ram sections parsed
    passthrough_at: int | None = None  # stream offset where parsing stopped (None: it never did)
    end_at: int | None = None          # stream offset of the ram section's END in precopy: QEMU's last pass, the
                                       # guest stopped (the switchover's own bytes follow)
    reason: str = ""                   # why it stopped
    blocks: list[tuple[str, int]] = field(default_factory=list)   # RAM blocks (idstr, length)

    @property
    def device_at(self) -> int | None:
        """The stream offset of the first device state (FULL section): where parsing stopped for it."""
        return self.passthrough_at if self.reason == DEVICE_STATE else None


class _Cursor:
    def __init__(self, buf: bytearray, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise _Short
        out = bytes(self.buf[self.pos:end])
        self.pos = end
        return out

    def u8(self) -> int:
        if self.pos >= len(self.buf):
            raise _Short
        self.pos += 1
        return self.buf[self.pos - 1]

    def peek(self) -> int:
        if self.pos >= len(self.buf):
            raise _Short
        return self.buf[self.pos]

    def be16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def be32(self) -> int:
        return int.from_bytes(self.take(4), "big")

    def be64(self) -> int:
        return int.from_bytes(self.take(8), "big")

    def name(self) -> str:
        return self.take(self.u8()).decode("latin-1")


class RamStream:
    """The parser of one stream (one direction of one connection). :meth:`feed` chunks, then :meth:`close`."""

    def __init__(self) -> None:
        self.counts = Counts()
        self._buf = bytearray()
        self._offset = 0                 # stream offset of _buf[0]
        self._state = "header"           # header | top | ram | config | skip | through
        self._skip = 0                   # bytes left to pass through in state skip
        self._ram_sid: int | None = None
        self._section = 0                # the section id being parsed (state ram)
        self._ignore_shared = False
        self._packaged = False           # a PACKAGED command came: post-copy (its END is not the switchover)

    @property
    def passthrough(self) -> bool:
        return self._state == "through"

    def feed(self, data: bytes) -> list[Item]:
        """What ``data`` (the next bytes of the stream) holds, as far as it can be told yet: the bytes of a unit
        that is still incomplete are kept until the next call."""
        out: list[Item] = []
        raw = bytearray()
        if self._state == "through":
            self._offset += len(data)
            return [(RAW, bytes(data))] if data else []
        self._buf += data
        pos = 0
        while pos < len(self._buf):
            if self._state == "skip":
                n = min(self._skip, len(self._buf) - pos)
                raw += self._buf[pos:pos + n]
                pos += n
                self._skip -= n
                if self._skip == 0:
                    self._state = "top"
                continue
            if self._state == "through":
                raw += self._buf[pos:]
                pos = len(self._buf)
                break
            cur = _Cursor(self._buf, pos)
            try:
                page = self._unit(cur)
            except _Short:
                break
            except _Unknown as why:
                self._stop(pos, str(why))
                continue
            if page is None:
                raw += self._buf[pos:cur.pos]
            else:
                raw += self._buf[pos:cur.pos - PAGE_SIZE]
                out.append((RAW, bytes(raw)))
                raw.clear()
                out.append((PAGE, bytes(self._buf[cur.pos - PAGE_SIZE:cur.pos])))
                self.counts.pages += 1
            pos = cur.pos
        if raw:
            out.append((RAW, bytes(raw)))
        del self._buf[:pos]
        self._offset += pos
        return [item for item in out if item[1]]

    def close(self) -> list[Item]:
        """The end of the stream: bytes of an unfinished unit are passed through as they came."""
        rest, self._buf = bytes(self._buf), bytearray()
        if rest and self._state != "through":
            self._stop(0, "the stream ended inside a record")
        self._offset += len(rest)
        return [(RAW, rest)] if rest else []

    def _stop(self, pos: int, reason: str) -> None:
        self._state = "through"
        self.counts.passthrough_at = self._offset + pos
        self.counts.reason = reason

    # -- one unit each: a header, a section's head, a command, one RAM record --------------------------------
    def _unit(self, c: _Cursor) -> bytes | None:
        """Parse one unit at ``c`` (raising _Short, _Unknown); answer the page when the unit was a PAGE record."""
        if self._state == "header":
            if c.be32() != MAGIC or c.be32() != VERSION:
                raise _Unknown("no QEMU migration stream header")
            self._state = "top"
            return None
        if self._state == "config":
            self._config_subsection(c)
            return None
        if self._state == "ram":
            return self._ram_record(c)
        kind = c.u8()
        if kind == CONFIGURATION:
            name_len = c.be32()
            if name_len > 256:
                raise _Unknown("a machine name longer than 256 bytes")
            c.take(name_len)
            self._state = "config"
        elif kind == START:
            sid, idstr = c.be32(), c.name()
            c.be32(), c.be32()                          # instance id, version id
            if idstr != "ram":
                raise _Unknown(f"iterative section {idstr!r}")
            self._ram_sid, self._section, self._state = sid, sid, "ram"
        elif kind in (PART, END):
            sid = c.be32()
            if sid != self._ram_sid:
                raise _Unknown(f"a section {sid} other than ram")
            self._section, self._state = sid, "ram"
            if kind == END and self.counts.end_at is None and not self._packaged:
                self.counts.end_at = self._offset + c.pos - 5
        elif kind == COMMAND:
            cmd, length = c.be16(), c.be16()
            data = c.take(length)
            if cmd == CMD_PACKAGED:
                self._packaged = True
                if length != 4:
                    raise _Unknown("a PACKAGED command without its be32 length")
                self._skip = struct.unpack(">I", data)[0]
                self._state = "skip" if self._skip else "top"
        else:                                           # FULL (device state), EOF (then VMDESC), unknown types
            raise _Unknown({FULL: DEVICE_STATE, EOF: "the end of the stream"}.get(kind, f"section type {kind}"))
        return None

    def _config_subsection(self, c: _Cursor) -> None:
        if c.peek() != SUBSECTION:
            self._state = "top"
            return
        c.u8()
        name = c.name()
        c.be32()                                        # version
        if name == "configuration/target-page-bits":
            if c.be32() != 12:
                raise _Unknown("a target page size other than 4 KiB")
        elif name == "configuration/capabilities":
            count = c.be32()
            if count > MAX_CAPABILITIES:
                raise _Unknown(f"{count} migration capabilities")
            caps = [c.name() for _ in range(count)]
            self._ignore_shared = "x-ignore-shared" in caps
        elif name == "configuration/uuid":
            c.take(16)
        else:
            raise _Unknown(f"configuration subsection {name!r}")

    def _ram_record(self, c: _Cursor) -> bytes | None:
        header = c.be64()
        flags = header & FLAGS_MASK
        if flags == F_EOS:
            if c.peek() == FOOTER:
                c.u8()
                if c.be32() != self._section:
                    raise _Unknown("a section footer naming another section")
            self.counts.sections += 1
            self._state = "top"
            return None
        if flags == F_MULTIFD_FLUSH:
            return None
        if flags == F_MEM_SIZE:
            self._mem_size(c, header & ~FLAGS_MASK)
            return None
        if flags & ~F_CONTINUE not in (F_ZERO, F_PAGE):
            raise _Unknown(f"RAM record flags {flags:#x}")
        if not flags & F_CONTINUE:
            c.name()
        if flags & F_ZERO:
            c.u8()
            self.counts.zero_pages += 1
            return None
        if c.pos + PAGE_SIZE > len(c.buf):
            raise _Short
        c.pos += PAGE_SIZE
        return b""

    def _mem_size(self, c: _Cursor, total: int) -> None:
        blocks: list[tuple[str, int]] = []
        seen = 0
        while seen < total:
            if len(blocks) >= MAX_BLOCKS:
                raise _Unknown("more RAM blocks than the parser takes")
            name, length = c.name(), c.be64()
            if self._ignore_shared:
                c.be64()
            blocks.append((name, length))
            seen += length
        if seen != total:
            raise _Unknown("RAM block sizes that do not add up to the total (huge pages?)")
        self.counts.blocks = blocks
