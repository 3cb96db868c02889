"""Exceptions raised by the disk server. Every message names the layer (and block) concerned.

They derive from the one root, :class:`hashcache.errors.Error` (exit code, HTTP status, wire code)."""

from __future__ import annotations

from hashcache.errors import Error


class DiskServerError(Error):
    """Base class of every error the disk server raises on purpose."""

    code = "diskserver"
    exit_code = 7


class SpecError(DiskServerError):
    """A chain spec is malformed, or the files it names do not match it."""

    code = "spec_error"
    exit_code = 6


class SourceError(DiskServerError):
    """The source host refused a request or answered something malformed (no point retrying)."""

    code = "source_error"
    exit_code = 13
    http_status = 502


class SourceUnavailable(SourceError):
    """The source host stayed unreachable (or kept failing) for the whole retry window."""

    code = "source_unavailable"
    exit_code = 12
    http_status = 503


class BlockMismatch(DiskServerError):
    """A block that arrived does not match its manifest hash: it is never served and never stored."""

    code = "block_mismatch"
    exit_code = 6
    http_status = 422
    fields = ("layer_id", "block")

    def __init__(self, message: str, *, layer_id: str, block: int) -> None:
        super().__init__(message)
        self.layer_id = layer_id
        self.block = block


class ServerError(DiskServerError):
    """The nbdkit process could not be started, did not become ready, or could not be stopped."""

    code = "server_error"
