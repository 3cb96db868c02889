"""A minimal NBD client over a unix socket (fixed newstyle handshake, simple replies, read-only).

Enough to check that a disk server is up (:func:`probe`), and for tests and benchmarks to read
through the real nbdkit without QEMU in the way (:class:`NbdClient`).
"""

from __future__ import annotations

import socket
import struct

NBDMAGIC = b"NBDMAGIC"
IHAVEOPT = b"IHAVEOPT"
_OPT_REPLY_MAGIC = 0x3E889045565A9
_REQUEST_MAGIC = 0x25609513
_SIMPLE_REPLY_MAGIC = 0x67446698
_FLAG_FIXED_NEWSTYLE = 1
_FLAG_NO_ZEROES = 2
_OPT_EXPORT_NAME = 1
_OPT_ABORT = 2
_CMD_READ = 0
_CMD_DISC = 2
_CMD_CACHE = 5


class NbdError(OSError):
    pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise NbdError(f"NBD server closed the connection ({got} of {n} bytes received)")
        got += k
    return bytes(buf)


def _handshake(sock: socket.socket) -> bool:
    """Read the server greeting, send client flags; returns whether NO_ZEROES was agreed."""
    head = _recv_exact(sock, 18)
    if head[:8] != NBDMAGIC or head[8:16] != IHAVEOPT:
        raise NbdError(f"not a newstyle NBD server (greeting {head[:16]!r})")
    (flags,) = struct.unpack(">H", head[16:18])
    no_zeroes = bool(flags & _FLAG_NO_ZEROES)
    sock.sendall(struct.pack(">I", _FLAG_FIXED_NEWSTYLE | (_FLAG_NO_ZEROES if no_zeroes else 0)))
    return no_zeroes


def probe(socket_path: str, timeout: float = 2.0) -> bool:
    """True if an NBD server answers the handshake on ``socket_path`` (then aborts politely)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_path)
            _handshake(sock)
            sock.sendall(IHAVEOPT + struct.pack(">II", _OPT_ABORT, 0))
            try:  # the server may acknowledge the abort before closing
                reply = sock.recv(20)
                if reply and len(reply) >= 8 and struct.unpack(">Q", reply[:8])[0] != _OPT_REPLY_MAGIC:
                    return False
            except OSError:
                pass
            return True
    except OSError:
        return False


class NbdClient:
    """One NBD connection: ``size``, ``pread(offset, length)``, ``cache(offset, length)``, ``close()``."""

    def __init__(self, socket_path: str, export: str = "", timeout: float | None = 60.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._handle = 0
        try:
            self._sock.connect(socket_path)
            no_zeroes = _handshake(self._sock)
            name = export.encode()
            self._sock.sendall(IHAVEOPT + struct.pack(">II", _OPT_EXPORT_NAME, len(name)) + name)
            info = _recv_exact(self._sock, 10 if no_zeroes else 134)
            self.size, self.flags = struct.unpack(">QH", info[:10])
        except BaseException:
            self._sock.close()
            raise

    def _request(self, cmd: int, offset: int, length: int) -> bytes:
        self._handle += 1
        self._sock.sendall(struct.pack(">IHHQQI", _REQUEST_MAGIC, 0, cmd, self._handle, offset, length))
        magic, error, handle = struct.unpack(">IIQ", _recv_exact(self._sock, 16))
        if magic != _SIMPLE_REPLY_MAGIC or handle != self._handle:
            raise NbdError(f"unexpected NBD reply (magic {magic:#x}, handle {handle})")
        if error:
            raise NbdError(error, f"NBD {'read' if cmd == _CMD_READ else 'command'} of {length} bytes at offset "
                                  f"{offset} failed: errno {error}")
        return _recv_exact(self._sock, length) if cmd == _CMD_READ else b""

    def pread(self, offset: int, length: int) -> bytes:
        return self._request(_CMD_READ, offset, length)

    def cache(self, offset: int, length: int) -> None:
        self._request(_CMD_CACHE, offset, length)

    def close(self) -> None:
        try:
            self._handle += 1
            self._sock.sendall(struct.pack(">IHHQQI", _REQUEST_MAGIC, 0, _CMD_DISC, self._handle, 0, 0))
        except OSError:
            pass
        finally:
            self._sock.close()

    def __enter__(self) -> NbdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
