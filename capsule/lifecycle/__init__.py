"""Lifecycle: running capsules on this host — start, suspend, snapshot, stop — and what that takes.

Owns the instance operations (``instances.py``: :func:`start`, :func:`suspend`, :func:`snapshot`,
:func:`stop`), sealing an instance's leaves into layers and a new version (``sealing.py``), the memory
image and the machine it restores into (``memimage.py``), ballooning before a save (``balloon.py``),
dropping zero marks the parent already reads as zero (``compact.py``) and demand-paged disks: remote
layers and the disk servers that export them (``demand.py``).

Layering: above the store, beside transfer, below migrate, the agent and the CLI. Modules here import
``capsule.store``, ``capsule.runtime`` (libvirt), ``capsule.console.serial`` (the serial log),
``diskserver``, ``hashcache`` and the leaf modules of ``capsule`` (errors, names, capsules, qemuimg, hosts,
the watcher ``capsule.watch``) — never transfer, migrate, the agent or the CLI. Callers write
``from capsule import lifecycle`` and ``lifecycle.start(...)``; a test that replaces what the operations
call (``lookup_domain``) patches ``capsule.lifecycle.instances``.
"""

from capsule.lifecycle.instances import (
    USER_NETWORK,
    SealResult,
    StartResult,
    accel_for,
    console_log,
    snapshot,
    start,
    stop,
    suspend,
)

__all__ = ["USER_NETWORK", "SealResult", "StartResult", "accel_for", "console_log", "snapshot", "start", "stop",
           "suspend"]
