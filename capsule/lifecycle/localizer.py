"""The localizer of ``capsule serve``: remote layers whose blocks have all arrived become local by themselves.

A demand-paged start (``capsule start NAME --from PEER|s3://…``, a live move's disks) leaves remote layers whose
blocks arrive as the guest reads them and, with ``--prefetch``, in the background. Once a layer's shadow is
complete nothing more comes from its source, but the layer stays remote, and the source's grant or the
repository's key stays on this host, until :func:`capsule.lifecycle.demand.localize` makes it an ordinary
layer. ``capsule localize`` does that on request; this thread does it every ``POLL`` seconds inside the agent,
so an instant restore is localized in the background with nobody watching.

A round that fails (a shadow block that does not match its manifest, a full disk) is logged and tried again at
the next round; the layer stays remote and keeps being served from its shadow and its source."""

from __future__ import annotations

import logging
from pathlib import Path

from capsule.errors import Error
from capsule.lifecycle import demand
from capsule.periodic import Periodic
from capsule.store import Store
from capsule.store.locks import LockTimeout

log = logging.getLogger("capsule.localizer")
POLL = 10.0       # seconds between rounds
LOCK_WAIT = 2.0   # seconds a round waits for the store's lock


class Localizer(Periodic):
    thread_name = "capsule-localizer"

    def __init__(self, store: Store, *, poll: float = POLL) -> None:
        super().__init__(poll)
        self.store = store
        self.localized: list[str] = []     # every layer this localizer made local, oldest first
        self.last_error: str | None = None

    def tick(self) -> list[str]:
        """One round: localize what is complete; returns the layers localized (none when a round fails). The
        store's lock is taken only when a layer is complete, and a store busy with other work for
        ``LOCK_WAIT`` seconds leaves the round to the next one."""
        if not demand.complete_layers(self.store):
            return []
        try:
            done = demand.localize(self.store, lock_timeout=LOCK_WAIT)
        except LockTimeout as exc:
            log.info("the store is busy; localizing waits for the next round: %s", exc)
            return []
        except (Error, OSError) as exc:
            self.last_error = str(exc)
            log.warning("localizing remote layers failed (tried again in %g s): %s", self.poll, exc)
            return []
        self.last_error = None
        if done:
            self.localized += done
            log.info("localized %d remote layer(s): %s", len(done), ", ".join(lid[:12] for lid in done))
        return done

    def round(self) -> None:
        self.tick()


def start_in_serve(home: Path) -> Localizer:
    """The localizer of ``capsule serve``: its own store handle, a daemon thread."""
    return Localizer(Store.open(home)).start()
