"""The store: one host's directory of sealed layers, file objects, instance leaves and the catalogue.

Owns the store's layout and format (``store.py``: :class:`Store`), the catalogue (``catalogue.py``) and its
tables (``schema.py``), the store lock (``locks.py``), claims on capsules (``claims.py``), file modes
(``modes.py``), reading, receiving and installing objects (``objectio.py``) and the file-system helpers they
share (``fsutil.py``).

Layering: the bottom of ``capsule``. Modules here import only ``capsule.errors``, ``capsule.names``,
``hashcache``, leaf helpers without capsule imports (``capsule.exchange.leases``, the ``capsule.pod``
role name) and each other — never transfer, lifecycle, migrate, the agent or the CLI. Modules of this
package import :class:`Store` from ``capsule.store.store``; everything else may write
``from capsule.store import Store``.
"""

from capsule.store.store import STORE_FORMAT, Store, default_home

__all__ = ["STORE_FORMAT", "Store", "default_home"]
