"""Where a running capsule's consoles are: its screen, the VNC server QEMU keeps on a unix socket in its instance
directory (``capsule.runtime.domainxml.add_screen``), and its serial console (a host pty, its output also in the
instance's console log). Nothing listens on a TCP port; the agent's console WebSockets
(``capsule.agent.console``) are the only way to them from outside this host."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from capsule.capsules import resolve
from capsule.catalogue import InstanceRow
from capsule.errors import Conflict
from capsule.memimage import VNC_SOCKET
from capsule.names import check_name
from capsule.runtime.connection import lookup_domain
from capsule.store import Store


@dataclass(frozen=True)
class Serial:
    pty: Path      # the host side of the guest's first serial port
    log: Path      # everything the guest wrote to it since it started on this host


def _instance(store: Store, name: str, what: str) -> InstanceRow:
    resolve(store, check_name(name))
    inst = store.catalogue.instance(name)
    if inst is None:
        raise Conflict(f"capsule {name!r} is not running, so it has no {what} (`capsule start {name}`)")
    return inst


def vnc_socket(store: Store, name: str) -> Path:
    """The unix socket of the running capsule ``name``'s VNC server. NotFound for an unknown capsule, Conflict
    when it is not running or has no screen (restored from a memory image saved before capsules had one)."""
    inst = _instance(store, name, "screen")
    sock = Path(inst.dir) / VNC_SOCKET
    if not sock.is_socket():
        raise Conflict(f"capsule {name!r} has no screen: it was restored from a memory image saved without one; "
                       "its next boot (`capsule stop`, then `capsule start`) gives it one")
    return sock


def serial_console(store: Store, name: str) -> Serial:
    """The running capsule ``name``'s serial console. NotFound / Conflict as :func:`vnc_socket`."""
    inst = _instance(store, name, "serial console")
    dom = lookup_domain(inst.domain)
    src = None if dom is None else ET.fromstring(dom.XMLDesc(0)).find("./devices/serial/source")
    path = None if src is None else src.get("path")
    if not path:
        raise Conflict(f"capsule {name!r} has no serial console pty (its domain is gone or has none)")
    return Serial(Path(path), Path(inst.dir) / "console.log")
