"""The dashboard API's request and response bodies (they document the API on the OpenAPI page, and a
peer's answers are checked against them). Every number a request gives is a bounded type
(:mod:`capsule.agent.bounded`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from capsule.agent.bounded import StopTimeout, Timeout, Version


class SignIn(BaseModel):
    token: str | None = Field(None, max_length=512,
                              description="The host's agent token (its token file's contents): only while this "
                                          "host has no admin user.")
    user: str | None = Field(None, max_length=64, description="A user name (`capsule user add`).")
    password: str | None = Field(None, max_length=1024, description="That user's password.")

    @model_validator(mode="after")
    def _one_way(self) -> SignIn:
        if (self.token is None) == (self.user is None and self.password is None):
            raise ValueError("give either a user and password, or the host's token")
        if self.token is None and (self.user is None or self.password is None):
            raise ValueError("give both the user and the password")
        return self


class SessionOut(BaseModel):
    store_id: str = Field(description="This host's store id.")
    csrf: str | None = Field(description="Send as the X-CSRF-Token header with every POST/DELETE "
                                         "(None for a bearer-token caller, which needs none).")
    expires_in: float | None = Field(description="Seconds until the session ends unless used.")
    user: str | None = Field(None, description="The user signed in (None: the host's token).")
    role: str | None = Field(None, description="Its role: owner, operator or admin.")


class RemoteOut(BaseModel):
    url: str
    blocks_local: int | None = None
    blocks: int | None = None


class LayerOut(BaseModel):
    id: str
    stored_bytes: int | None
    file_bytes: int | None
    remote: RemoteOut | None = None


class MemoryOut(BaseModel):
    id: str
    size: int
    allocated: int
    stored_bytes: int


class DependsOn(BaseModel):
    url: str = Field(description="The agent this version still reads disk blocks from.")
    host: str | None = Field(description="That agent's name among this host's peers, if it is one.")


class VersionOut(BaseModel):
    ref: str
    capsule: str
    version: int
    active: bool = Field(description="Has a memory image (restores) rather than booting.")
    parent: str | None
    memory: MemoryOut | None
    disks: list[list[LayerOut]] = Field(description="Per disk, the chain of layers from root to top.")
    config: dict[str, Any]
    note: str
    created: float


class VersionDetail(VersionOut):
    depends_on: list[DependsOn]
    disk_bytes: int = Field(description="Data bytes of all layers of the version's chains.")


class CapsuleOut(BaseModel):
    name: str
    state: Literal["running", "arriving", "suspended", "stopped", "crashed"]
    latest: int
    active: bool
    domain: str | None
    version_count: int
    versions: list[VersionDetail]


class HostOut(BaseModel):
    name: str
    url: str
    store_id: str
    reachable: bool
    error: str | None = Field(description="Why the host is unreachable (or its answer unusable).")
    seconds: float = Field(description="How long the host took to answer.")
    capsules: list[CapsuleOut] | None = Field(description="None when the host is unreachable.")


class StartIn(BaseModel):
    version: Version | None = Field(default=None, description="Start this version (default: latest).")
    wait: bool = Field(default=True, description="Wait until a booting guest is up.")
    timeout: Timeout = Field(default=180.0, description="Seconds to wait for a booting guest.")


class StartOut(BaseModel):
    version: str
    domain: str
    mode: Literal["boot", "restore"]
    accel: str
    seconds: float
    forked_memory: bool


class SealIn(BaseModel):
    balloon: bool = Field(default=False, description="Zero the guest's spare memory first (§4.1).")
    balloon_policy: Literal["none", "cache", "aggressive"] = "cache"
    balloon_method: Literal["virtio", "agent"] = "virtio"


class StopIn(BaseModel):
    timeout: StopTimeout = Field(default=30.0, description="Seconds to wait for a clean shutdown.")
    force: bool = Field(default=False, description="Power off at once.")


class LayerSize(BaseModel):
    id: str
    stored_bytes: int
    file_bytes: int


class SealOut(BaseModel):
    version: str | None = Field(description="The new version (None: nothing changed).")
    memory: MemoryOut | None
    layers: list[LayerSize]
    balloon: dict[str, Any] | None
    save_seconds: float
    seal_seconds: float


class SnapshotOut(SealOut):
    resumed: StartOut


class DeriveIn(BaseModel):
    child: str = Field(description="Name of the new child capsule.")
    version: Version | None = Field(default=None, description="Derive from this version (default: latest).")


class RmIn(BaseModel):
    version: Version | None = Field(default=None, description="Remove only this version.")
    promote: bool = Field(default=False, description="Fold removed layers into versions that build on them.")


class GcOut(BaseModel):
    layers: list[str]
    files: list[str]
    leaves: list[str]
    freed_bytes: int


class RmOut(BaseModel):
    removed: list[str]
    promoted_layers: int
    gc: GcOut


# -- the hierarchy (GET /api/tree; capsule tree --json) ------------------------------------------------------
class TreeLayer(BaseModel):
    id: str
    parent: str | None = Field(description="The layer this one builds on (None: a root, or a parent not known here).")
    depth: int = Field(description="How many layers are below it (0: a root).")
    stored_bytes: int | None
    file_bytes: int | None
    created: float
    remote: RemoteOut | None = Field(description="Held by another agent (demand paging): its URL.")
    images: list[str] = Field(description="Images whose root layer this is.")
    versions: list[str] = Field(description="Versions (NAME@V) one of whose disks ends in this layer.")


class TreeImage(BaseModel):
    name: str
    kind: str
    root_layer: str


class TreeCapsule(BaseModel):
    name: str
    state: Literal["running", "arriving", "suspended", "stopped", "crashed", "empty"]
    parent: str | None = Field(description="The version it was derived from.")
    image: str | None


class TreeVersion(BaseModel):
    ref: str
    capsule: str
    version: int
    active: bool
    parent: str | None
    tops: list[str | None] = Field(description="Per disk, the layer its chain ends in.")
    chains: list[list[str]] = Field(description="Per disk, the chain of layers from root to top.")
    memory: str | None = Field(description="Its memory image's id.")
    running: bool = Field(description="An instance of this version runs here.")
    created: float


class TreeMemory(BaseModel):
    id: str
    size: int
    allocated: int
    stored_bytes: int
    versions: list[str]


class TreeInstance(BaseModel):
    capsule: str
    version: int
    ref: str
    domain: str
    state: str
    tops: list[str | None] = Field(description="Per disk, the layer its private leaf is on.")
    started: float


class TreeOut(BaseModel):
    store_id: str
    layers: list[TreeLayer] = Field(description="Parents before children, siblings oldest first.")
    images: list[TreeImage]
    capsules: list[TreeCapsule]
    versions: list[TreeVersion]
    memory_images: list[TreeMemory]
    instances: list[TreeInstance]
