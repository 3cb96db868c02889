"""What a fleet host does when the rollout asks it: pull a version from another host (so any agent can
pass a version on: fan-out), remember the pulls it made and count what it served (so a rollout's tree
can be checked from the hosts' side), and put a version into service (``activate``)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from capsule.bounds import TIMEOUT, VERSION, ZSTD_LEVEL, check
from capsule.errors import Conflict, InvalidName
from capsule.names import check_name, parse_ref
from capsule.store import Store

if TYPE_CHECKING:
    from capsule.transfer import TransferReport

MAX_LOG = 256


class Activity:
    """This agent's recent pulls (where from, what, how many bytes) and counts of what it served,
    in memory (they start again with the agent)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pulls: deque[dict[str, Any]] = deque(maxlen=MAX_LOG)
        self.served_reads = 0
        self.served_blocks = 0

    def pulled(self, ref: str, source: str, wire_bytes: int) -> None:
        with self._lock:
            self.pulls.append({"ref": ref, "source": source, "wire_bytes": wire_bytes, "at": time.time()})

    def served(self, blocks: int) -> None:
        with self._lock:
            self.served_reads += 1
            self.served_blocks += blocks

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"pulls": list(self.pulls), "served_reads": self.served_reads,
                    "served_blocks": self.served_blocks}


def parse_pull_request(req: Any) -> tuple[str, str, str]:
    """(source agent URL, its token, NAME@V) of a pull request, or InvalidName; a source over plain HTTP off
    loopback is refused before anything is sent to it (:mod:`hashcache.transport.plain`)."""
    from capsule.hosts import check_url
    from hashcache.transport import plain

    if not isinstance(req, dict):
        raise InvalidName("malformed pull request: expected a JSON object")
    source, token, ref = req.get("source"), req.get("token"), req.get("ref")
    if not isinstance(source, str) or not isinstance(token, str) or not isinstance(ref, str):
        raise InvalidName("a pull request needs source (an agent URL), token and ref (NAME@V)")
    if parse_ref(ref).version is None:
        raise InvalidName(f"a pull request names one version (NAME@V), not {ref!r}")
    if not 16 <= len(token) <= 4096 or any(c.isspace() for c in token):
        raise InvalidName("the source's token must be 16 to 4096 characters with no spaces")
    source = check_url(source)
    plain.check(source)
    return source, token, ref


def pull_level(req: Any) -> int | None:
    """The zstd level a pull request asks the source to send at (``zstd_level``, 1..19; None if absent: the
    puller picks it by the link it measures)."""
    if not isinstance(req, dict) or "zstd_level" not in req:
        return None
    return int(check(ZSTD_LEVEL, req["zstd_level"], "zstd_level"))


def pull_from(store: Store, req: Any, activity: Activity) -> TransferReport:
    """Pull NAME@V from the agent named in the request into this store (HCP: only what is lacking), the
    blocks compressed by the source at the request's ``zstd_level`` (or at levels picked by the link)."""
    from capsule import transfer
    from capsule.exchange.running import request_pin

    source, token, ref = parse_pull_request(req)
    level = pull_level(req)
    report = transfer.pull(store, source, ref, token, transfer.Options(level=level), fingerprint=request_pin(req))
    activity.pulled(ref, source, report.wire_bytes)
    return report


def activate(store: Store, name: str, version: int, timeout: float = 180.0) -> str:
    """Run ``name@version`` here: a running instance of another version is stopped first — its system
    disk's changes are dropped, since the fleet's version replaces them — and nothing happens if that
    version already runs. An instance with data disks is refused before anything stops. Says what
    it did."""
    from capsule import lifecycle
    from capsule.capsules import resolve
    from capsule.store import claims

    check_name(name)
    timeout = check(TIMEOUT, timeout, "timeout")
    ref = f"{name}@{check(VERSION, version, 'version')}"
    resolve(store, ref)  # NotFound before anything stops
    with claims.claim(store, name, "activating"):   # nothing starts it between the stop and the start
        inst = store.catalogue.instance(name)
        what = ""
        if inst is not None:
            if inst.version == version:
                return f"{ref} already runs"
            if len(inst.chains) > 1:      # its data disks would be dropped with the system disk's changes
                raise Conflict(f"{name}@{inst.version} runs here with {len(inst.chains) - 1} data disk(s): activating "
                               f"{ref} would drop what was written on them. Stop it first (`capsule stop {name}` "
                               f"keeps its changes as a version), or keep user data in a capsule derived from "
                               f"{name} and move that with `capsule update apply`; nothing was changed")
            lifecycle.stop(store, name, discard=True)
            what = f"stopped {name}@{inst.version}, "
        try:
            lifecycle.start(store, ref, timeout=timeout)
        except Exception as exc:
            raise Conflict(f"{what}then starting {ref} failed: {exc}") from exc
        return f"{what}started {ref}"
