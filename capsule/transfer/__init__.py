"""Transfer: push and pull of capsule versions and file objects between hosts with HCP (§4.4).

Owns the sender loop (``pushing.py``: :func:`push`, :func:`push_files`), the fetching loop (``pulling.py``:
:func:`pull`, and :func:`run`, a demand-paged run of another host's version), what both are asked and
report (``terms.py``), the codec blocks travel in, picked by the link (``codecpick.py``), the requests kept
in flight (``pipeline.py``), a push's pacing to the rate the receiver acknowledges (``pacing.py``), sending
a batch again after a lost answer (``resend.py``) and version records as they travel (``records.py``).

Layering: above the store. Modules here import ``capsule.store``, the leaf modules of ``capsule``
(errors, names, bounds, capsules, hosts, the agent client ``capsule.agentclient``), ``capsule.exchange.streams``
and ``hashcache`` — never migrate, the agent or the CLI. A run starts the capsule it pulled, so
``pulling.run`` and ``records.record_version`` reach into ``capsule.lifecycle`` (demand-paged layers) from
inside the function, as before. Callers write ``from capsule import transfer`` and ``transfer.push(...)``;
a test that changes a module constant patches the module that reads it (``capsule.transfer.pushing``).
"""

from capsule.transfer.pulling import RunReport, pull, run
from capsule.transfer.pushing import push, push_files, raw_size
from capsule.transfer.terms import ObjectReport, Options, Progress, TransferReport

__all__ = ["ObjectReport", "Options", "Progress", "RunReport", "TransferReport", "pull", "push", "push_files",
           "raw_size", "run"]
