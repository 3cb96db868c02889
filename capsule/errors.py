"""Typed errors. Every error carries a message a user can act on; the CLI maps
each class to an exit code (see ``exit_code``)."""

from __future__ import annotations


class CapsuleError(Exception):
    """Base of every error Capsule raises on purpose."""

    exit_code = 1


class InvalidName(CapsuleError):
    """A capsule, image or version reference is malformed."""

    exit_code = 2


class NotFound(CapsuleError):
    """An unknown capsule, version, image, layer or memory image."""

    exit_code = 3


class AlreadyExists(CapsuleError):
    exit_code = 4


class Conflict(CapsuleError):
    """The operation is refused in the current state (running, has dependants …)."""

    exit_code = 5


class SealedObjectError(Conflict):
    """Something tried to modify a sealed (immutable) layer or memory image."""


class IntegrityError(CapsuleError):
    """A stored object does not match its manifest, or an image is corrupt."""

    exit_code = 6


class RuntimeFailure(CapsuleError):
    """libvirt or QEMU failed (domain did not start, save failed, …)."""

    exit_code = 7


class StorageFull(CapsuleError):
    """The store's file system ran out of space; nothing was half-written."""

    exit_code = 8


class EnvironmentProblem(CapsuleError):
    """A required tool or service is missing (see ``capsule doctor``)."""

    exit_code = 9


class GuestTimeout(CapsuleError):
    """The guest did not reach the expected state in time."""

    exit_code = 10


class AuthFailed(CapsuleError):
    """The agent refused the token (or none was given)."""

    exit_code = 11


class Unreachable(CapsuleError):
    """The other host's agent cannot be reached."""

    exit_code = 12


class TransferFailed(CapsuleError):
    """A peer sent something wrong (a block that does not match its hash, a malformed reply)."""

    exit_code = 13
