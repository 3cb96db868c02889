"""Opening the libvirt connection."""

from __future__ import annotations

import os
from functools import lru_cache

import libvirt

from capsule.errors import EnvironmentProblem


def libvirt_uri() -> str:
    env = os.environ.get("CAPSULE_LIBVIRT_URI")
    if env:
        return env
    return "qemu:///system" if os.geteuid() == 0 else "qemu:///session"


def _quiet(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; we raise typed errors instead."""


@lru_cache(maxsize=4)
def _open(uri: str) -> libvirt.virConnect:
    libvirt.registerErrorHandler(_quiet, None)
    try:
        return libvirt.open(uri)
    except libvirt.libvirtError as exc:
        raise EnvironmentProblem(
            f"cannot connect to libvirt at {uri}: {exc.get_error_message()}. "
            "Is libvirtd running? (`make setup` starts it; `capsule doctor` checks)"
        ) from exc


def connect() -> libvirt.virConnect:
    conn = _open(libvirt_uri())
    try:
        if conn.isAlive():
            return conn
    except libvirt.libvirtError:
        pass
    _open.cache_clear()
    return _open(libvirt_uri())


def lookup_domain(name: str) -> libvirt.virDomain | None:
    try:
        return connect().lookupByName(name)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return None
        raise


def state_of(dom: libvirt.virDomain) -> tuple[int, int] | None:
    """libvirt's (state, reason) of ``dom``; None when libvirt cannot say (the domain went away)."""
    try:
        state, reason = dom.state()
    except libvirt.libvirtError:
        return None
    return state, reason


def postcopy_failed(dom: libvirt.virDomain, *, incoming: bool) -> bool:
    """Whether libvirt holds ``dom`` in a post-copy that lost its link: at the source paused (post-copy failed); at
    the destination (``incoming``) running or paused (post-copy failed), its vCPUs waiting on pages still at the
    source."""
    failed = [(libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_POSTCOPY_FAILED)]
    if incoming:
        failed.append((libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_POSTCOPY_FAILED))
    return state_of(dom) in failed


def host_uuid() -> str | None:
    """libvirt's host UUID here (``<host><uuid>`` of its capabilities: ``host_uuid`` in libvirtd.conf, else the
    machine's SMBIOS UUID), lower case; None when libvirt does not answer or names none."""
    import xml.etree.ElementTree as ET

    try:
        caps = connect().getCapabilities()
    except (libvirt.libvirtError, EnvironmentProblem):
        return None
    el = ET.fromstring(caps).find("host/uuid")
    return el.text.strip().lower() if el is not None and el.text else None
