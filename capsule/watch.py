"""A small supervisor for demand-paged instances (§4.3 reliability).

When the source host of a remote layer cannot be reached, the disk server
fails the read after its retry window, and QEMU, whose disks have error
policy ``stop``, pauses the guest instead of letting it see an I/O error.
This watcher runs beside such an instance: while the domain is paused for an
I/O error it probes the source agents, and resumes the guest (QEMU retries
the failed request) once they answer. It exits when the domain is gone.

    python -m capsule.watch DOMAIN URL [URL ...]
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import libvirt

from capsule.runtime.connection import connect, lookup_domain

POLL = 0.5


def _reachable(urls: list[str]) -> bool:
    for url in urls:
        try:
            httpx.get(f"{url}/v1/info", timeout=2.0)  # any HTTP answer (even 401) means the agent is back
        except httpx.TransportError:
            return False
    return True


def watch(domain: str, urls: list[str]) -> None:
    connect()
    while True:
        dom = lookup_domain(domain)
        if dom is None:
            return
        try:
            state, reason = dom.state()
        except libvirt.libvirtError:
            return
        if state == libvirt.VIR_DOMAIN_PAUSED and reason == libvirt.VIR_DOMAIN_PAUSED_IOERROR and _reachable(urls):
            with contextlib.suppress(libvirt.libvirtError):
                dom.resume()
        time.sleep(POLL)


def spawn(domain: str, urls: list[str], log: Path) -> int:
    """Start a detached watcher; returns its pid."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "capsule.watch", domain, *urls], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, start_new_session=True)
    return proc.pid


if __name__ == "__main__":
    watch(sys.argv[1], sys.argv[2:])
