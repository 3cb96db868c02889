"""Exceptions raised by hashcache.

Every message is meant to be shown to a user as is: it names the file or object concerned, says
what is wrong and, where there is one, what to do about it.
"""

from __future__ import annotations


class HashcacheError(Exception):
    """Base class of every error hashcache raises on purpose."""


class ManifestError(HashcacheError):
    """A manifest is malformed, inconsistent with its own digest, or cannot be read."""


class ManifestMismatch(HashcacheError):
    """Data does not match the manifest it is supposed to match.

    ``object_name`` names the object checked (as the caller named it); ``block`` is the index of the
    first block found to differ, or None when the mismatch is not about one block (size, kind, digest).
    """

    def __init__(self, message: str, *, object_name: str, block: int | None = None) -> None:
        super().__init__(message)
        self.object_name = object_name
        self.block = block

    def __reduce__(self) -> tuple[object, ...]:
        # Keep the keyword-only attributes across pickling (e.g. from a worker process).
        return (_rebuild_mismatch, (str(self), self.object_name, self.block))


def _rebuild_mismatch(message: str, object_name: str, block: int | None) -> ManifestMismatch:
    return ManifestMismatch(message, object_name=object_name, block=block)


class CorruptImageError(HashcacheError):
    """A qcow2 image is damaged or not a qcow2 image at all (the message names the file and the fault)."""


class UnsupportedImageError(HashcacheError):
    """A valid qcow2 image uses a feature this reader deliberately does not handle."""
