"""What only root may do for a store, as plain operations on already-opened files (no path is trusted here).

An agent that runs as an unprivileged user (``capsule serve --user``) asks its root helper
(:mod:`capsule.privsep.helper`) for these, which checks each path first; a process that is root itself calls
them directly (:class:`capsule.privsep.Direct`). Every operation works on file descriptors the caller opened
without following symbolic links, so a path swapped after it was checked changes nothing."""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from capsule import sandbox
from capsule.errors import Conflict
from capsule.runtime import guestfiles, podnet
from capsule.runtime.connection import lookup_domain

MEMORY_IMAGE_MODE = 0o600
SANDBOX_DIR_MODE = 0o710     # the sandbox user may enter its work directory, not change or list it
SANDBOX_FILE_MODE = 0o600
MAX_STDERR = 1 << 20         # what a sandboxed tool's standard error may bring back


@dataclass(frozen=True)
class Owner:
    """The store's owner: who the files root hands back must belong to."""

    uid: int
    gid: int


def adopt_memory_image(fd: int, owner: Owner) -> None:
    """A memory image libvirtd (root) just wrote becomes the store owner's (0600), so it can hash and seal it."""
    os.fchown(fd, owner.uid, owner.gid)
    os.fchmod(fd, MEMORY_IMAGE_MODE)


def pod_bridge_up() -> str:
    """The host's pod bridge, created and brought up if needed (CAP_NET_ADMIN)."""
    return podnet.ensure_bridge()


def sandbox_hand_over(dir_fd: int, file_fd: int) -> None:
    """A work directory and the private copy in it, handed to the sandbox user: the directory (kept by its owner,
    who removes it afterwards) gets group ``capsule-sandbox`` and 0710, the copy becomes the sandbox user's (0600)."""
    uid, gid = sandbox.ids()
    os.fchown(dir_fd, -1, gid)
    os.fchmod(dir_fd, SANDBOX_DIR_MODE)
    os.fchown(file_fd, uid, gid)
    os.fchmod(file_fd, SANDBOX_FILE_MODE)


def run_sandboxed(argv: list[str], cwd_fd: int, stdout_fd: int, *, timeout: float) -> tuple[int, bytes]:
    """``argv`` as the sandbox user with no capabilities (:func:`capsule.sandbox.command`), started in the
    directory ``cwd_fd``, its standard output into ``stdout_fd``: (exit status, standard error)."""
    proc = subprocess.run(sandbox.command(argv), cwd=f"/proc/self/fd/{cwd_fd}", env=sandbox.ENV,
                          stdin=subprocess.DEVNULL, stdout=stdout_fd, stderr=subprocess.PIPE, timeout=timeout,
                          check=False)
    return proc.returncode, proc.stderr[-MAX_STDERR:]


def open_serial(domain: str) -> int:
    """A descriptor on the serial console of the running libvirt domain ``domain``: the pty QEMU made for it, as
    libvirt names it, opened as :func:`capsule.runtime.guestfiles.open_pty` checks it (QEMU's user owns it, mode
    0620: only root or that user may open it)."""
    dom = lookup_domain(domain)
    src = None if dom is None else ET.fromstring(dom.XMLDesc(0)).find("./devices/serial/source")
    path = None if src is None else src.get("path")
    if not path:
        raise Conflict(f"the domain {domain} has no serial console pty (it is gone or has none)")
    return guestfiles.open_pty(Path(path))


def connect_agent(domain: str, path: Path, timeout: float) -> int:
    """A descriptor on a connection to the guest agent of the running libvirt domain ``domain``, through its
    channel socket at ``path``, which must be the one libvirt names in the domain's definition: libvirt makes that
    socket, root's (mode 0775), so only root may connect to it. Checked and connected as
    :func:`capsule.runtime.guestfiles.connect_socket` does (never through a link)."""
    dom = lookup_domain(domain)
    if dom is None or not dom.isActive():
        raise Conflict(f"the domain {domain} is not running, so its guest agent cannot be reached")
    channels = ET.fromstring(dom.XMLDesc(0)).findall("./devices/channel/source")
    if str(path) not in {c.get("path") for c in channels}:
        raise Conflict(f"{path} is not a channel socket of the domain {domain}; refused")
    sock = guestfiles.connect_socket(path, "the guest agent's socket", timeout, root_too=True)
    return sock.detach()
