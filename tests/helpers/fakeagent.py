"""The guest agent's side of its JSON lines, for the fakes that stand in for it in tests."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
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
