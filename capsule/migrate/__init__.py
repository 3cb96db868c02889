"""Migrate: move a running capsule to another host — suspend here, push, start there (§5.3).

Owns the one call the CLI and the dashboard make (``move.py``; a live move in ``live.py``, its pre-check in
``precheck.py``: :func:`migrate`, its result and its
errors :class:`MigrationFailed` and :class:`MigrationCancelled`) and what a migration reports while it
runs and how it is cancelled (``progress.py``: phases, snapshots, the cancel token), and the source side of
the byte tunnel a live move runs libvirt and QEMU through (``tunnelset.py``: :func:`tunnelset.open_tunnels`; an
entrance, ``tunnel.py``; its destination side is ``capsule/exchange/tunnel.py``).

Layering: above transfer and lifecycle, below the agent and the CLI. Modules here import
``capsule.store``, ``capsule.transfer``, ``capsule.lifecycle`` and the leaf modules of ``capsule``
(errors, units, hosts, the agent client), and ``tunnel.py`` what QEMU may reach (``capsule.runtime.guestaccess``);
``move.own_fingerprint`` reads this host's certificate through
``capsule.agent.serve`` from inside the function, as before. Callers write ``from capsule import migrate``
and ``migrate.migrate(...)``.
"""

from capsule.migrate.move import (
    MAX_PAUSE,
    MODES,
    RECOVER_TIMEOUT,
    MigrateResult,
    MigrationCancelled,
    MigrationFailed,
    Reached,
    Steps,
    migrate,
)

__all__ = ["MAX_PAUSE", "MODES", "MigrateResult", "MigrationCancelled", "MigrationFailed", "RECOVER_TIMEOUT", "Reached",
           "Steps", "migrate"]
