"""A peer's requests to run a capsule on this host (the destination side of ``capsule migrate`` and
of ``capsule start --from`` driven from elsewhere), checked before anything starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from capsule.bounds import TIMEOUT, VERSION, check
from capsule.errors import InvalidName
from capsule.names import check_name
from capsule.store import Store
from hashcache.transport import plain
from hashcache.transport.tls import parse_fingerprint

if TYPE_CHECKING:
    from capsule.lifecycle import SealResult, StartResult
    from capsule.transfer import RunReport


def start(store: Store, name: str, version: int | None = None, timeout: float = 180.0) -> StartResult:
    """Start ``name`` (its latest version, or ``version``) here, waiting ``timeout`` seconds (1 s … 15 min) for a
    booting guest."""
    from capsule import lifecycle

    check_name(name)
    timeout = check(TIMEOUT, timeout, "timeout")
    ref = name if version is None else f"{name}@{check(VERSION, version, 'version')}"
    return lifecycle.start(store, ref, timeout=timeout)


def stop(store: Store, name: str, discard: bool = False) -> SealResult:
    """Stop ``name`` here: its disk changes become a version, or are dropped (``discard``)."""
    from capsule import lifecycle

    check_name(name)
    return lifecycle.stop(store, name, discard=discard)


def parse_run_request(req: Any) -> tuple[str, str, str, bool]:
    """(source agent URL, its token, NAME[@V], prefetch) of a run request, or InvalidName; a source over plain
    HTTP off loopback is refused before anything is sent to it or kept (:mod:`hashcache.transport.plain`)."""
    try:
        source, token, ref = req["source"], req["token"], req["ref"]
        prefetch = bool(req.get("prefetch", False))
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidName(f"malformed run request: {exc}") from exc
    if not isinstance(source, str) or not source.startswith(("http://", "https://")) or not isinstance(token, str):
        raise InvalidName("run needs a source agent URL and its token")
    plain.check(source)
    return source, token, str(ref), prefetch


def run_from(store: Store, req: Any) -> RunReport:
    """Start here a capsule of another host, its disks paged in on demand (``transfer.run``)."""
    from capsule import transfer

    source, token, ref, prefetch = parse_run_request(req)
    return transfer.run(store, source, ref, token, prefetch=prefetch, fingerprint=request_pin(req))


def request_pin(req: Any) -> str | None:
    """The source's certificate fingerprint a run or pull request gives (``"fingerprint"``), or None (then
    this host's pin for that URL, or CA validation, applies)."""
    pin = req.get("fingerprint") if isinstance(req, dict) else None
    if pin is None:
        return None
    if not isinstance(pin, str):
        raise InvalidName("the source's fingerprint must be a string (SHA256:…)")
    return parse_fingerprint(pin)
