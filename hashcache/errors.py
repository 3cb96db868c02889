"""Exceptions: the one root of every error raised on purpose, and hashcache's own.

Every message is meant to be shown to a user as is: it names the file or object concerned, says
what is wrong and, where there is one, what to do about it.

:class:`Error` is the root for all three packages (hashcache, diskserver, capsule): it lives here, in
the lowest layer, and knows nothing of capsules. Each class carries

- ``exit_code``: what the command line exits with;
- ``http_status``: what the agent answers with;
- ``code``: a stable name on the wire (JSON ``{"error": code, "detail": message, ...fields}``). A
  client turns the code back into the same class (see :func:`from_wire`); renaming a class keeps its
  code, so peers of different versions still understand each other;
- ``fields``: the keyword-only attributes that travel with it (e.g. the object and block of a mismatch).

Every subclass registers itself under its code (its own ``code``, else its name in snake_case).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

MAX_DETAIL = 4000  # characters of a peer's message kept (a hostile peer could send megabytes)

_REGISTRY: dict[str, type[Error]] = {}
_BY_NAME: dict[str, type[Error]] = {}
_BY_STATUS: dict[int, type[Error]] = {}


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


class Error(Exception):
    """Base of every error Capsule (hashcache, diskserver, capsule) raises on purpose."""

    code: ClassVar[str] = "error"
    exit_code: ClassVar[int] = 1
    http_status: ClassVar[int] = 500
    fields: ClassVar[tuple[str, ...]] = ()
    status_default: ClassVar[bool] = False  # the class a client falls back to for its http_status

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        code = cls.__dict__.get("code") or _snake(cls.__name__)
        other = _REGISTRY.get(code)
        if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"error code {code!r} of {cls.__qualname__} is taken by {other.__qualname__}")
        cls.code = code
        _REGISTRY[code] = cls
        _BY_NAME.setdefault(cls.__name__, cls)
        if cls.__dict__.get("status_default"):
            _BY_STATUS[cls.http_status] = cls

    def to_wire(self) -> dict[str, Any]:
        """What the agent answers: the code, the message, and the structured fields."""
        out: dict[str, Any] = {"error": self.code, "detail": str(self)}
        for name in self.fields:
            out[name] = getattr(self, name, None)
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        # keep the keyword-only fields across pickling (e.g. from a worker process)
        return (_rebuild, (type(self), str(self), {f: getattr(self, f, None) for f in self.fields}))


def _rebuild(cls: type[Error], message: str, fields: dict[str, Any]) -> Error:
    return cls(message, **fields) if fields else cls(message)


_REGISTRY["error"] = Error
_BY_NAME["Error"] = Error


def registered() -> dict[str, type[Error]]:
    """Every error class known in this process, by wire code."""
    return dict(_REGISTRY)


def error_class(code: str | None, status: int) -> type[Error]:
    """The class a peer's error reply names: by its code (or, from an older peer, its class name), else
    the default class for its HTTP status, else :class:`PeerError`."""
    if isinstance(code, str):
        cls = _REGISTRY.get(code) or _BY_NAME.get(code)
        if cls is not None:
            return cls
    return _BY_STATUS.get(status, PeerError)


def from_wire(body: Any, status: int, prefix: str = "") -> Error:
    """The exception a peer's error reply describes, with its message (``prefix`` first, e.g. the host)."""
    if not isinstance(body, dict):
        body = {"detail": str(body)}
    cls = error_class(body.get("error"), status)
    detail = str(body.get("detail", "") or f"HTTP {status}")[:MAX_DETAIL]
    message = prefix + detail
    kwargs = {f: body.get(f) for f in cls.fields}
    try:
        exc = cls(message, **kwargs) if kwargs else cls(message)
    except (TypeError, ValueError):  # fields missing or of the wrong type: keep the class's meaning
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        for f, v in kwargs.items():
            setattr(exc, f, v)
    return exc


# -- kinds every layer needs (the transport and the command line) ------------------------------------

class PeerError(Error):
    """The other host refused a request for a reason this side does not know (its message says why)."""

    code = "peer_error"
    exit_code = 13
    http_status = 502


class ProtocolMismatch(Error):
    """The other side speaks a protocol this release no longer speaks (it is more than one release older, or
    asks for what its release was given and this one no longer gives). The message names both releases."""

    code = "protocol_mismatch"
    exit_code = 13
    http_status = 400


class AuthFailed(Error):
    """The agent refused the token (or none was given)."""

    code = "auth_failed"
    exit_code = 11
    http_status = 401
    status_default = True


class Forbidden(Error):
    """The caller is known, but its role or its token's scopes do not allow this call (or the capsule is not
    theirs). The message says what the call needs."""

    code = "forbidden"
    exit_code = 18
    http_status = 403
    status_default = True


class Unreachable(Error):
    """The other host's agent cannot be reached (refused, reset, timed out)."""

    code = "unreachable"
    exit_code = 12
    http_status = 503

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused  # the connection was refused: nobody listens (not worth a retry, usually)


class Overloaded(Error):
    """The other host's agent refused the request for now: this client holds too many connections at once,
    or tried to sign in too often. Retry after the time the reply gives (``retry_after`` seconds)."""

    code = "overloaded"
    exit_code = 12
    http_status = 429
    status_default = True


class TooManyAttempts(Overloaded):
    """Too many failed sign-ins from one address or for one user in a short time: wait ``retry_after`` seconds."""

    code = "too_many_attempts"
    status_default = False
    fields = ("retry_after",)

    def __init__(self, message: str, *, retry_after: int = 60) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeout(Error):
    """A request did not arrive in time (its headers trickled in too slowly): the agent closed the connection."""

    code = "request_timeout"
    exit_code = 12
    http_status = 408
    status_default = True


class HostKeyError(Error):
    """The other host's TLS certificate is not the one pinned for it (its host key changed, or someone is in
    the middle), or it is self-signed and no fingerprint was given for it. Never retried."""

    code = "host_key"
    exit_code = 11
    http_status = 502


class InsecureTransport(Error):
    """A bearer token would go over plain HTTP to another machine (readable by anyone on the path): refused
    before any connection unless this side was configured for it (:mod:`hashcache.transport.plain`)."""

    code = "insecure_http"
    exit_code = 2
    http_status = 400


class InvalidInput(Error):
    """A request or argument is malformed."""

    code = "invalid_input"
    exit_code = 2
    http_status = 400


class Internal(Error):
    """Something failed that was not expected (a bug): the message says what; please report it."""

    code = "internal"
    exit_code = 70
    http_status = 500
    status_default = True


# -- hashcache -----------------------------------------------------------------------------------------

class HashcacheError(Error):
    """Base class of every error hashcache raises on purpose."""

    code = "hashcache"
    exit_code = 6


class ManifestError(HashcacheError):
    """A manifest is malformed, inconsistent with its own digest, or cannot be read."""

    code = "manifest_error"
    http_status = 400


class ManifestMismatch(HashcacheError):
    """Data does not match the manifest it is supposed to match.

    ``object_name`` names the object checked (as the caller named it); ``block`` is the index of the
    first block found to differ, or None when the mismatch is not about one block (size, kind, digest).
    """

    code = "manifest_mismatch"
    http_status = 422
    fields = ("object_name", "block")

    def __init__(self, message: str, *, object_name: str, block: int | None = None) -> None:
        super().__init__(message)
        self.object_name = object_name
        self.block = block


class CorruptImageError(HashcacheError):
    """A qcow2 image is damaged or not a qcow2 image at all (the message names the file and the fault)."""

    code = "corrupt_image"
    http_status = 422


class UnsupportedImageError(HashcacheError):
    """A valid qcow2 image uses a feature this reader deliberately does not handle."""

    code = "unsupported_image"
    http_status = 422
