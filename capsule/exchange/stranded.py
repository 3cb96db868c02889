"""The destination's half of a post-copy whose link broke (the source side: :mod:`capsule.migrate.recover`).

A guest that arrived by post-copy and lost its link runs here without all its memory (libvirt: running or paused,
post-copy failed); its vCPUs wait on every page still at the source. Its source retries for its recover timeout
(named in the prepare request, kept in the move's ``incoming.json``). If the link returns in that time the
post-copy resumes and ``finish`` adopts the guest; if not, the source starts the capsule again there, and the
half here can never complete. :class:`Watch` (a thread of ``capsule serve``) removes such a half once it has
waited the source's timeout and :data:`MARGIN` more (the source gives up first, then stops trying), with
everything the move's prepare made: its domain, leaves and instance. A move whose guest recovers meanwhile is
left alone, and its wait starts again at its next break."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path

import libvirt

from capsule import bounds
from capsule.errors import Error
from capsule.exchange import incoming
from capsule.periodic import Periodic
from capsule.runtime.connection import lookup_domain, postcopy_failed
from capsule.store import Store
from capsule.store.locks import LockTimeout

log = logging.getLogger("capsule.stranded")
POLL = 5.0                 # seconds between two looks
MARGIN = 30.0              # seconds waited beyond the source's recover timeout
DEFAULT_RECOVER = 120.0    # a source that named none (an older release)
SINCE = "stranded_since"   # in the move's mark: when this host first saw its post-copy fail
LOCK_WAIT = 2.0


def wait_of(mark: dict) -> float:
    """How long a stranded half waits: its source's recover timeout (bounded), and :data:`MARGIN`."""
    try:
        recover = float(bounds.check(incoming.RECOVER, mark.get("recover_timeout", DEFAULT_RECOVER), "recover timeout"))
    except Error:
        recover = DEFAULT_RECOVER
    return recover + MARGIN


def tick(store: Store, now: float | None = None) -> list[str]:
    """One look: each unfinished incoming move whose post-copy failed is marked with when that was first seen,
    and removed once it has waited :func:`wait_of`; the capsules removed."""
    now = time.time() if now is None else now
    gone = []
    for inst, mark in incoming.unfinished(store):
        dom = lookup_domain(inst.domain)
        path = Path(inst.dir) / incoming.MARK
        if dom is None or not postcopy_failed(dom, incoming=True):
            if SINCE in mark:                      # it recovered: its wait starts again at the next break
                mark.pop(SINCE)
                _write(path, mark)
            continue
        since = mark.get(SINCE)
        if not isinstance(since, (int, float)) or not math.isfinite(since) or since > now:
            mark[SINCE] = now
            _write(path, mark)
            log.warning("the post-copy of %s lost its link: it is removed here unless it resumes within %.0f s",
                        inst.capsule, wait_of(mark))
            continue
        if now - since < wait_of(mark):
            continue
        with store.lock(timeout=LOCK_WAIT, purpose=f"removing the stranded post-copy of {inst.capsule}"):
            still = [i for i, _m in incoming.unfinished(store) if i.capsule == inst.capsule]
            dom = lookup_domain(inst.domain)
            if still and dom is not None and postcopy_failed(dom, incoming=True):
                incoming.remove(store, still[0])
                gone.append(inst.capsule)
                log.warning("removed the half of %s that arrived by post-copy: its link did not return within "
                            "%.0f s, and its source started it again there", inst.capsule, wait_of(mark))
    return gone


def _write(path: Path, mark: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(mark))
        tmp.replace(path)


class Watch(Periodic):
    """:func:`tick` every ``poll`` seconds in a daemon thread."""

    thread_name = "capsule-stranded"

    def __init__(self, store: Store, *, poll: float = POLL) -> None:
        super().__init__(poll)
        self.store = store

    def round(self) -> None:
        try:
            tick(self.store)
        except LockTimeout:
            return
        except (Error, OSError, libvirt.libvirtError) as exc:
            log.warning("looking for stranded post-copies failed: %s", exc)


def start_in_serve(home: Path) -> Watch:
    return Watch(Store.open(home)).start()
