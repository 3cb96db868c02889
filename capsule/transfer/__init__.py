"""Transfer: push and pull of capsule versions and file objects between hosts with HCP (§4.4).

Owns the sender and receiver loops (``pushpull.py``: :func:`push`, :func:`pull`, :func:`push_files`, and
:func:`run`, a demand-paged run of another host's version), the requests kept in flight
(``pipeline.py``), a push's pacing to the rate the receiver acknowledges (``pacing.py``) and version
records as they travel (``records.py``).

Layering: above the store. Modules here import ``capsule.store``, the leaf modules of ``capsule``
(errors, names, bounds, capsules, hosts, the agent client ``capsule.agentclient``), ``capsule.exchange.streams``
and ``hashcache`` — never migrate, the agent or the CLI. A run starts the capsule it pulled, so
``pushpull.run`` and ``records.record_version`` reach into ``capsule.lifecycle`` (demand-paged layers) from
inside the function, as before. Callers write ``from capsule import transfer`` and ``transfer.push(...)``;
a test that changes a module constant patches ``capsule.transfer.pushpull``.
"""

from capsule.transfer.pushpull import (
    ObjectReport,
    Options,
    Progress,
    RunReport,
    TransferReport,
    pull,
    push,
    push_files,
    raw_size,
    run,
)

__all__ = ["ObjectReport", "Options", "Progress", "RunReport", "TransferReport", "pull", "push", "push_files",
           "raw_size", "run"]
