"""A small supervisor for demand-paged instances (§4.3 reliability).

When the source host of a remote layer cannot be reached, the disk server
fails the read after its retry window, and QEMU, whose disks have error
policy ``stop``, pauses the guest instead of letting it see an I/O error.
This watcher runs beside such an instance: while the domain is paused for an
I/O error it probes the source agents (or the object store of a repository
the layers are paged from), and resumes the guest (QEMU retries
the failed request) once they answer. It also keeps the instance's disk
servers up: one that died (a crash, a SIGKILL) is started again on the same
socket and spec; QEMU's NBD client reconnects to it (``reconnect-delay``, or
on the retried request after a pause), and the blocks it had fetched are in
the shadows. It exits when the domain is gone.

    python -m capsule.watch DOMAIN [--instance DIR] URL [URL ...]
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from pathlib import Path

import httpx
import libvirt

from capsule.runtime.connection import connect, lookup_domain

POLL = 0.5
log = logging.getLogger("capsule.watch")


def probe_url(url: str) -> str:
    """What to ask to learn whether a source answers: an agent's info route, or a repository's endpoint."""
    if url.startswith(("http://", "https://")):
        return f"{url}/v1/info"
    from capsule.repo.s3 import parse_url

    return parse_url(url).endpoint + "/"


def reachable(urls: list[str]) -> bool:
    """Whether every source answers (any HTTP answer, even 401 or 403, means it is back)."""
    for url in urls:
        try:
            httpx.get(probe_url(url), timeout=2.0)
        except httpx.TransportError:
            return False
    return True


def _domain_state(domain: str) -> tuple[int, int] | None:
    dom = lookup_domain(domain)
    if dom is None:
        return None
    try:
        return tuple(dom.state())
    except libvirt.libvirtError:
        return None


def revive_servers(domain: str, inst_dir: Path) -> list[int]:
    """Start again every disk server of the instance that is not running, while its domain still exists
    (a stop destroys the domain before it stops the servers, so a server stopped on purpose is never
    revived; one revived in that window is stopped again). Returns the disks whose server was revived."""
    from capsule.lifecycle import demand

    revived = []
    for spec in sorted(inst_dir.glob("disk*.spec.json")):
        disk = int(spec.name[4:].split(".")[0])
        server = demand.server_for(inst_dir, disk)
        if server.alive() or _domain_state(domain) is None:
            continue
        try:
            server.start()
        except Exception as exc:  # the next poll tries again; the guest waits paused meanwhile
            log.warning("disk server of disk %d did not start again: %s", disk, exc)
            continue
        if _domain_state(domain) is None:
            server.stop()
            continue
        log.warning("disk server of disk %d had died; started again (pid %s)", disk, server.pid)
        revived.append(disk)
    return revived


def _servers_up(inst_dir: Path | None) -> bool:
    from capsule.lifecycle import demand

    if inst_dir is None:
        return True
    return all(demand.server_for(inst_dir, int(p.name[4:].split(".")[0])).alive()
               for p in inst_dir.glob("disk*.spec.json"))


def watch(domain: str, urls: list[str], inst_dir: Path | None = None) -> None:
    connect()
    while (state := _domain_state(domain)) is not None:
        if inst_dir is not None:
            revive_servers(domain, inst_dir)
        if (state == (libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_IOERROR) and _servers_up(inst_dir)
                and reachable(urls)):
            dom = lookup_domain(domain)
            if dom is not None:
                with contextlib.suppress(libvirt.libvirtError):
                    dom.resume()
        time.sleep(POLL)


def spawn(domain: str, urls: list[str], log_path: Path, inst_dir: Path | None = None) -> int:
    """Start a detached watcher; returns its pid."""
    argv = [sys.executable, "-m", "capsule.watch", domain]
    if inst_dir is not None:
        argv += ["--instance", str(inst_dir)]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([*argv, *urls], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
    return proc.pid


def main(argv: list[str]) -> None:
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)
    inst_dir = None
    if argv[1:2] == ["--instance"]:
        inst_dir, argv = Path(argv[2]), [argv[0], *argv[3:]]
    watch(argv[0], argv[1:], inst_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
