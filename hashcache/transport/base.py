"""The transport interface: a :class:`Call` goes in, a :class:`Reply` comes out.

A transport raises :class:`~hashcache.errors.Unreachable` when the call did not get an answer
(``refused=True`` when nobody listens); an answer, error statuses included, is a :class:`Reply`.
:func:`check` turns an error reply into the typed error it describes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from hashcache import wirejson
from hashcache.errors import AuthFailed, Error, from_wire
from hashcache.hcp import ProtocolError, encode_indices

TOKEN_ENV = "CAPSULE_TOKEN"


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    params: Mapping[str, Any] | None = None
    content: bytes = b""
    json: bool = False            # the content is JSON
    idempotent: bool = False      # may be sent again after a broken connection
    timeout: float | None = None  # seconds for this call (None: the transport's default)

    @classmethod
    def get(cls, path: str, params: Mapping[str, Any] | None = None) -> Call:
        return cls("GET", path, params=params, idempotent=True)

    @classmethod
    def post_json(cls, path: str, body: Any, *, idempotent: bool = False) -> Call:
        return cls("POST", path, content=json.dumps(body).encode(), json=True, idempotent=idempotent)

    def with_timeout(self, timeout: float) -> Call:
        return replace(self, timeout=timeout)


def read_call(kind: str, oid: str, indices: list[int], *, level: int, compress: bool = True) -> Call:
    """HCP READ: blocks ``indices`` (ascending) of an object (zstd at ``level`` unless not ``compress``)."""
    return Call("POST", f"/v1/objects/{kind}/{oid}/read", params={"level": str(level),
                                                                   "compress": "true" if compress else "false"},
                content=encode_indices(indices), idempotent=True)


@dataclass
class Reply:
    status: int
    content: bytes
    headers: Mapping[str, str] = field(default_factory=dict)  # HTTP: case-insensitive names
    wire_bytes: int = 0   # request + answer on the wire, headers and framing included (about)
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return self.status < 400

    def json(self) -> Any:
        """The body as JSON; a peer's malformed JSON is a :class:`~hashcache.hcp.ProtocolError`."""
        try:
            return wirejson.loads(self.content)
        except ValueError as exc:
            raise ProtocolError(f"the agent answered HTTP {self.status} with malformed JSON: {exc}") from None


class Transport(Protocol):
    """One agent. Thread-safe: many threads may call at once."""

    url: str

    def call(self, call: Call) -> Reply: ...

    def close(self) -> None: ...


def error_of(reply: Reply, who: str) -> Error:
    """The typed error an error reply describes, its message prefixed with ``who`` said it."""
    try:
        body: Any = reply.json()
    except ProtocolError:
        body = {"detail": reply.content[:300].decode("utf-8", "replace") or f"HTTP {reply.status}"}
    if not isinstance(body, dict):
        body = {"detail": str(body)[:300]}
    if not isinstance(body.get("detail"), str):  # e.g. FastAPI's list of validation problems
        body = dict(body, detail=json.dumps(body.get("detail"))[:300] if "detail" in body else f"HTTP {reply.status}")
    return from_wire(body, reply.status, prefix=f"{who}: ")


def check(reply: Reply, who: str) -> Reply:
    """``reply`` if it is an answer, else raise the error it describes."""
    if reply.status >= 400:
        raise error_of(reply, who)
    return reply


def read_token(token_file: str | Path | None, env: str = TOKEN_ENV) -> str:
    """A client's token: the file's content, else (no file given) the environment variable ``env``."""
    if token_file is not None:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise AuthFailed(f"cannot read the token file {token_file}: {exc.strerror or exc}") from exc
        if not token:
            raise AuthFailed(f"the token file {token_file} is empty")
        return token
    token = os.environ.get(env, "").strip()
    if not token:
        raise AuthFailed(f"no token: pass --token-file FILE or set {env}")
    return token


class TokenSource:
    """The bearer token a transport sends; read again from its file (once) when the agent refuses it."""

    def __init__(self, token: str, token_file: str | Path | None = None) -> None:
        self.value = token
        self.file = Path(token_file) if token_file is not None else None

    @classmethod
    def from_file(cls, token_file: str | Path) -> TokenSource:
        return cls(read_token(token_file), token_file)

    def reload(self) -> bool:
        """Read the file again; True when the token changed (it may have been rotated)."""
        if self.file is None:
            return False
        try:
            token = read_token(self.file)
        except AuthFailed:
            return False
        changed, self.value = token != self.value, token
        return changed

    @property
    def header(self) -> str:
        return f"Bearer {self.value}"
