"""Typed errors. Every error carries a message a user can act on, the exit code the CLI exits with,
the HTTP status the agent answers with, and a stable wire code (see :mod:`hashcache.errors`, where
the one root :class:`Error` lives: hashcache and diskserver errors derive from it too)."""

from __future__ import annotations

from hashcache.errors import (
    AuthFailed,
    Error,
    Forbidden,
    Internal,
    InvalidInput,
    Overloaded,
    PeerError,
    TooManyAttempts,
    Unreachable,
)

__all__ = ["AlreadyExists", "AuthFailed", "CapsuleBusy", "CapsuleError", "Cancelled", "Conflict", "EnvironmentProblem",
           "Error", "Forbidden", "GuestTimeout", "IntegrityError", "Internal", "InvalidInput", "InvalidName",
           "NotFound", "PeerError", "RequestTooLarge", "RuntimeFailure", "SealedObjectError", "StorageFull",
           "TooManyAttempts", "TooManyOperations", "TransferFailed", "Unreachable"]


class CapsuleError(Error):
    """Base of every error the capsule package raises on purpose."""

    code = "capsule"
    exit_code = 1


class InvalidName(CapsuleError):
    """A capsule, image or version reference is malformed (or a request is)."""

    code = "invalid_name"
    exit_code = 2
    http_status = 400
    status_default = True


class NotFound(CapsuleError):
    """An unknown capsule, version, image, layer or memory image."""

    code = "not_found"
    exit_code = 3
    http_status = 404
    status_default = True


class AlreadyExists(CapsuleError):
    code = "already_exists"
    exit_code = 4
    http_status = 409


class Cancelled(CapsuleError):
    """Someone asked to stop a long operation (a migration cancelled from the page, or Ctrl-C)."""

    code = "cancelled"
    exit_code = 15
    http_status = 409


class Conflict(CapsuleError):
    """The operation is refused in the current state (running, has dependants …)."""

    code = "conflict"
    exit_code = 5
    http_status = 409
    status_default = True


class CapsuleBusy(Conflict):
    """Another operation is under way on this capsule (``doing``: "stopping", "suspending" …); others are not
    held up by it. Try again when it is done."""

    code = "capsule_busy"
    status_default = False
    fields = ("doing",)

    def __init__(self, message: str, *, doing: str = "busy") -> None:
        super().__init__(message)
        self.doing = doing


class TooManyOperations(Overloaded):
    """One owner asked this host for more capsule operations at once than it runs for one owner: wait
    ``retry_after`` seconds, or for one of them to finish."""

    code = "too_many_operations"
    status_default = False
    fields = ("retry_after", "limit")

    def __init__(self, message: str, *, retry_after: int = 10, limit: int = 0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.limit = limit


class SealedObjectError(Conflict):
    """Something tried to modify a sealed (immutable) layer or memory image."""

    code = "sealed_object"
    status_default = False


class IntegrityError(CapsuleError):
    """A stored object does not match its manifest, or an image is corrupt."""

    code = "integrity"
    exit_code = 6
    http_status = 422
    status_default = True


class RuntimeFailure(CapsuleError):
    """libvirt or QEMU failed (domain did not start, save failed, …)."""

    code = "runtime_failure"
    exit_code = 7


class StorageFull(CapsuleError):
    """The store's file system ran out of space; nothing was half-written."""

    code = "storage_full"
    exit_code = 8
    http_status = 507
    status_default = True


class EnvironmentProblem(CapsuleError):
    """A required tool or service is missing (see ``capsule doctor``)."""

    code = "environment"
    exit_code = 9


class GuestTimeout(CapsuleError):
    """The guest did not reach the expected state in time."""

    code = "guest_timeout"
    exit_code = 10
    http_status = 504


class TransferFailed(CapsuleError):
    """A peer sent something wrong (a block that does not match its hash, a malformed reply)."""

    code = "transfer_failed"
    exit_code = 13
    http_status = 502
    status_default = True


class RequestTooLarge(CapsuleError):
    """A request body is over the agent's limit."""

    code = "too_large"
    exit_code = 13
    http_status = 413
    status_default = True
