"""Where a running capsule's screen is: the VNC server QEMU keeps on a unix socket in its instance directory
(``capsule.runtime.domainxml.add_screen``). Nothing listens on a TCP port; the agent's console WebSocket
(``capsule.agent.console``) is the only way to it from outside this host."""

from __future__ import annotations

from pathlib import Path

from capsule.capsules import resolve
from capsule.errors import Conflict
from capsule.memimage import VNC_SOCKET
from capsule.names import check_name
from capsule.store import Store


def vnc_socket(store: Store, name: str) -> Path:
    """The unix socket of the running capsule ``name``'s VNC server. NotFound for an unknown capsule, Conflict
    when it is not running or has no screen (restored from a memory image saved before capsules had one)."""
    resolve(store, check_name(name))
    inst = store.catalogue.instance(name)
    if inst is None:
        raise Conflict(f"capsule {name!r} is not running, so it has no screen (`capsule start {name}`)")
    sock = Path(inst.dir) / VNC_SOCKET
    if not sock.is_socket():
        raise Conflict(f"capsule {name!r} has no screen: it was restored from a memory image saved without one; "
                       "its next boot (`capsule stop`, then `capsule start`) gives it one")
    return sock
