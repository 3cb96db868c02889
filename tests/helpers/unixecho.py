"""A unix-socket server standing in for a tunnel's target (libvirtd, QEMU): echoes every byte; once its client
half-closes, it sends :data:`TRAILER` and closes. Counts the connections it accepted."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

TRAILER = b"<the echo saw EOF>"


class Echo:
    def __init__(self, path: Path, backlog: int = 32) -> None:
        self.path, self.accepted = path, 0
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen(backlog)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    @staticmethod
    def _one(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)
                conn.sendall(TRAILER)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
