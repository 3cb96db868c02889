"""Pod errors: typed subclasses of the capsule error root, one per kind the guest's pod layer reports."""

from __future__ import annotations

from capsule.errors import (
    AlreadyExists,
    Conflict,
    EnvironmentProblem,
    GuestTimeout,
    IntegrityError,
    InvalidName,
    NotFound,
    RuntimeFailure,
)


class PodNotFound(NotFound):
    """No such pod in that capsule, or no such pod image in the store."""

    code = "pod_not_found"


class PodNameInvalid(InvalidName):
    """A pod name, a CAPSULE/POD reference or a pod address is malformed."""

    code = "pod_name_invalid"


class PodExists(AlreadyExists):
    code = "pod_exists"


class PodAddressClash(Conflict):
    """The pod's address is taken (or its network overlaps another pod's) in the capsule."""

    code = "pod_address_clash"


class PodStateConflict(Conflict):
    """The pod is not in a state for this (suspended, exited)."""

    code = "pod_state"


class PodLayerMissing(EnvironmentProblem):
    """The capsule's guest has no pod layer (``pods/`` is installed in the Debian image)."""

    code = "pod_layer_missing"


class PodLayerOutdated(PodLayerMissing):
    """The capsule's pod layer predates what was asked of it (its command line refused a verb or an option):
    the host falls back to what that layer offers."""

    code = "pod_layer_outdated"


class PodFailed(RuntimeFailure):
    """The pod layer in the guest failed (namespaces, veth, cgroup)."""

    code = "pod_failed"


class CheckpointFailed(RuntimeFailure):
    """CRIU refused to dump or restore the pod (its log's errors are in the message)."""

    code = "pod_checkpoint_failed"


class CriuUnsupported(EnvironmentProblem):
    """CRIU refuses this capsule's kernel (``criu check`` failed): no checkpoint, restore or migration of
    its pods; they run on untouched. The message quotes CRIU's reason."""

    code = "pod_criu_unsupported"


class PodTimeout(GuestTimeout):
    code = "pod_timeout"


BY_KIND = {
    "not_found": PodNotFound,
    "invalid_name": PodNameInvalid,
    "already_exists": PodExists,
    "ip_clash": PodAddressClash,
    "conflict": PodStateConflict,
    "guest_timeout": PodTimeout,
    "criu_failed": CheckpointFailed,
    "criu_unsupported": CriuUnsupported,
    "integrity": IntegrityError,
    "pod_failed": PodFailed,
}
