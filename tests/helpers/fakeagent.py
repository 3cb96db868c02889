"""The guest agent's side of its JSON lines, for the fakes that stand in for it in tests."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def requests(conn: socket.socket) -> Iterator[tuple[dict[str, Any], int]]:
    """Each request the host sends on ``conn`` (blank lines skipped), parsed, with its line's length; ends
    when the host closes the connection."""
    buf = b""
    while chunk := conn.recv(1 << 16):
        buf += chunk
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            if line.strip():
                yield json.loads(line), len(line)


def reply(conn: socket.socket, rid: Any, result: dict[str, Any]) -> None:
    conn.sendall(json.dumps({"id": rid, "ok": True, "result": result}).encode() + b"\n")


class ExecAgent:
    """A guest agent on the unix socket ``path`` that answers ``ping``, and ``exec`` with ``answer(argv, args)``
    (an exec result); it records every argv it was asked to run and the longest request line."""

    def __init__(self, path: Path, answer: Callable[[list[str], dict[str, Any]], Any]) -> None:
        self.argvs: list[list[str]] = []
        self.longest = 0
        self.answer = answer
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                for req, size in requests(conn):
                    self.longest = max(self.longest, size)
                    if req["cmd"] == "ping":
                        reply(conn, req["id"], {})
                        continue
                    self.argvs.append(req["args"].get("argv"))
                    reply(conn, req["id"], self.answer(req["args"]["argv"], req["args"]))

    def ran(self, word: str) -> list[list[str]]:
        return [a for a in self.argvs if any(word in part for part in a)]
