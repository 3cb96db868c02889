"""Exceptions raised by the disk server. Every message names the layer (and block) concerned."""

from __future__ import annotations


class DiskServerError(Exception):
    """Base class of every error the disk server raises on purpose."""


class SpecError(DiskServerError):
    """A chain spec is malformed, or the files it names do not match it."""


class SourceError(DiskServerError):
    """The source host refused a request or answered something malformed (no point retrying)."""


class SourceUnavailable(SourceError):
    """The source host stayed unreachable (or kept failing) for the whole retry window."""


class BlockMismatch(DiskServerError):
    """A block that arrived does not match its manifest hash: it is never served and never stored."""

    def __init__(self, message: str, *, layer_id: str, block: int) -> None:
        super().__init__(message)
        self.layer_id = layer_id
        self.block = block

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_mismatch, (str(self), self.layer_id, self.block))


def _rebuild_mismatch(message: str, layer_id: str, block: int) -> BlockMismatch:
    return BlockMismatch(message, layer_id=layer_id, block=block)


class ServerError(DiskServerError):
    """The nbdkit process could not be started, did not become ready, or could not be stopped."""
