"""A minimal RFB (VNC) client for the console latency benchmark: RFB 3.8 with no security, Raw encoding,
key events and framebuffer update requests, over any byte stream (a unix socket, or the agent's console
WebSocket). Enough to time "key typed → screen changed"; not a viewer."""

from __future__ import annotations

import struct
from collections.abc import Callable

KEY_A = 0x61


class Rfb:
    def __init__(self, send: Callable[[bytes], None], recv: Callable[[], bytes]) -> None:
        self._send = send
        self._recv = recv
        self._buf = b""
        self.width = self.height = 0
        self.bpp = 4

    def _read(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self._recv()
            if not chunk:
                raise ConnectionError("the VNC server closed the connection")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def handshake(self) -> None:
        version = self._read(12)
        if not version.startswith(b"RFB 003."):
            raise ConnectionError(f"not an RFB server: {version!r}")
        self._send(b"RFB 003.008\n")
        (count,) = self._read(1)
        types = self._read(count)
        if 1 not in types:
            raise ConnectionError(f"the server wants authentication (types {list(types)})")
        self._send(b"\x01")
        (result,) = struct.unpack(">I", self._read(4))
        if result != 0:
            raise ConnectionError("the server refused the connection")
        self._send(b"\x01")                                  # shared
        self.width, self.height = struct.unpack(">HH", self._read(4))
        fmt = self._read(16)
        self.bpp = fmt[0] // 8
        (name_len,) = struct.unpack(">I", self._read(4))
        self._read(name_len)
        self._send(struct.pack(">BxHi", 2, 1, 0))            # SetEncodings: Raw only

    def request(self, incremental: bool) -> None:
        self._send(struct.pack(">BBHHHH", 3, int(incremental), 0, 0, self.width, self.height))

    def key(self, keysym: int) -> None:
        for down in (1, 0):
            self._send(struct.pack(">BBxxI", 4, down, keysym))

    def update(self) -> int:
        """Read server messages until one framebuffer update; the number of pixels it carried."""
        while True:
            (kind,) = self._read(1)
            if kind == 0:
                (_pad, n) = struct.unpack(">BH", self._read(3))
                pixels = 0
                for _ in range(n):
                    _x, _y, w, h, enc = struct.unpack(">HHHHi", self._read(12))
                    if enc == 0:
                        self._read(w * h * self.bpp)
                        pixels += w * h
                    elif enc == -223:                        # DesktopSize pseudo-encoding
                        self.width, self.height = w, h
                    else:
                        raise ConnectionError(f"unexpected encoding {enc}")
                return pixels
            if kind == 2:                                    # bell
                continue
            if kind == 1:                                    # colour map entries
                _pad, _first, n = struct.unpack(">BHH", self._read(5))
                self._read(6 * n)
                continue
            if kind == 3:                                    # server cut text
                self._read(3)
                (n,) = struct.unpack(">I", self._read(4))
                self._read(n)
                continue
            raise ConnectionError(f"unexpected server message {kind}")
