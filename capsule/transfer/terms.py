"""The terms of a transfer between hosts: what it is asked to do (:class:`Options`), what it reports
(:class:`ObjectReport`, :class:`TransferReport`, :class:`Progress`) and the pinned client of the agent at
the other end. ``pushing.py`` sends, ``pulling.py`` fetches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from capsule.agentclient import AgentClient
from capsule.store import Store
from capsule.transfer import codecpick
from capsule.transfer.codecpick import CodecPicker
from hashcache.hcp import (
    PREFIX_SIZE,
)
from hashcache.transport import Transport

CodecName = Literal["auto", "zstd", "xz", "none"]


@dataclass
class Options:
    """How blocks travel. The codec is picked by the link (``codecpick.py``) unless one is given: ``level``
    (zstd at that level), ``xz`` (one xz stream per object where the receiver takes it) or ``compress=False``
    force it; ``codec`` says which ("auto" when none is)."""

    hash: bool = True          # look blocks up in the receiver's hash cache
    compress: bool = True      # compressed on the wire (False: forced "none")
    level: int | None = None   # zstd level given (None: picked by the link)
    batch: int = 256           # blocks per request
    inflight: int = 8          # requests in flight
    full_hashes: bool = False  # send whole 32-byte hashes instead of 8-byte prefixes + digest check
    xz: bool = False           # blocks as one xz (LZMA2) stream per object where the receiver takes it
    deltas: bool = True        # a layer's blocks as deltas against its parent's where they pay (deltapick.py)
    like: bool = True          # a memory image's manifest against an older one the receiver holds (manifestparts.py)
    codec: CodecName = "auto"

    def __post_init__(self) -> None:
        if not self.compress:
            self.codec = "none"
        elif self.xz:
            self.codec = "xz"
        elif self.level is not None and self.codec == "auto":
            self.codec = "zstd"

    @property
    def hash_len(self) -> int:
        return 32 if self.full_hashes else PREFIX_SIZE

    def picker(self, stream_level: int) -> CodecPicker:
        """A new transfer's codec picker (a pull asks for frames: ``stream_level`` above 19)."""
        return codecpick.for_transfer(self.codec, self.level, self.inflight, stream_level)


@dataclass
class ObjectReport:
    kind: str
    id: str
    role: str
    raw_bytes: int = 0
    resumed_bytes: int = 0
    cache_bytes: int = 0
    fetched_bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0
    commit_seconds: float = 0.0      # the receiver verifying, writing and recording the object
    codec: str = ""                  # the codec most of its sent bytes travelled in (codecpick.py)
    codecs: dict[str, int] = field(default_factory=dict)   # raw bytes sent in each codec
    link_rate: float | None = None   # the link's rate (bytes/s) measured when its codec was last picked
    delta_blocks: int = 0            # blocks sent as deltas against the parent's (push; capsule/transfer/similar.py)
    delta_bytes: int = 0             # their bytes on the wire (delta records)
    # whether its blocks were tried as deltas (capsule/transfer/deltapick.py): "" not (no parent the receiver
    # holds, --no-deltas, a codec given that is no stream codec), "given" (a stream codec given: every block
    # that pays), else the link's pick last taken: "used", "declined" or "unmeasured"
    deltas: str = ""
    delta_figures: dict[str, float] = field(default_factory=dict)   # what that pick was taken on (per MB)
    like: str | None = None          # the file its manifest parts were compressed against (manifestparts.py)

    def used(self, picker: CodecPicker, codecs: dict[str, int]) -> ObjectReport:
        """This report with the codecs ``codecs`` counts and the link rate ``picker`` picked them at."""
        self.codecs = dict(codecs)
        self.codec = max(codecs, key=lambda c: codecs[c]) if codecs else ""
        self.link_rate = picker.link_at_pick
        return self


@dataclass
class TransferReport:
    direction: str
    version: str
    url: str
    objects: list[ObjectReport] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)      # objects the receiver already had
    wire_bytes: int = 0
    seconds: float = 0.0
    recorded: bool = False

    def totals(self) -> dict[str, int]:
        keys = ("raw_bytes", "resumed_bytes", "cache_bytes", "fetched_bytes")
        return {k: sum(getattr(o, k) for o in self.objects) for k in keys}

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(self.totals())
        return d


class Progress:
    """Callbacks for a progress display: begin(total raw bytes), advance(raw bytes), wire(total wire bytes).
    A push also says which object comes next (``object``: its role and raw size, ``present`` when the
    receiver holds it already) and how many of the raw bytes it advanced by the receiver found itself
    (``local``: in its shadow or hash cache, never sent)."""

    def begin(self, label: str, total: int) -> None: ...

    def advance(self, n: int) -> None: ...

    def wire(self, total_wire: int) -> None: ...

    def object(self, kind: str, oid: str, role: str, raw_bytes: int, present: bool) -> None: ...

    def local(self, n: int) -> None: ...


Check = Callable[[], None]


def never() -> None:
    pass


def agent_client(store: Store, url: str, token: str, fingerprint: str | None, transport: Transport | None = None,
            **kw: Any) -> AgentClient:
    """The client of the agent at ``url``, its certificate pinned to ``fingerprint`` or, without one, to the
    known host's at that URL (:func:`capsule.hosts.pin_for`)."""
    from capsule import hosts

    return AgentClient(url, token, transport=transport, fingerprint=hosts.pin_for(store, url, fingerprint), **kw)
