"""Privilege separation: the few operations that need root, behind one interface with two implementations.

- :class:`Direct`: this process is root (the CLI run by root on a root-owned store, an agent started without
  ``--user``): the operations run here, as before.
- :class:`capsule.privsep.helper.HelperClient`: this process gave up root (``capsule serve --user USER``, or the
  CLI run by root on a store another user owns, :mod:`capsule.privsep.drop`); a small root helper it forked
  first runs a fixed command set for it, each path checked to lie in the store's ``tmp/``.

The command set (:mod:`capsule.privsep.ops`): take ownership of a memory image libvirtd wrote, bring up the pod
bridge, hand a private copy to the sandbox user and run ``e2fsck``/``debugfs`` as that user, open a running
capsule's serial console pty (QEMU's user owns it) and connect to its guest agent's socket (libvirt makes it root's)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Protocol

from capsule.privsep import ops
from capsule.runtime import guestfiles


class Privileged(Protocol):
    def adopt_memory_image(self, path: Path) -> None:
        """``path`` (a memory image libvirtd just wrote in the store's tmp/) becomes the store owner's."""

    def pod_bridge_up(self) -> str:
        """The host's pod bridge exists and is up; its name."""

    def sandbox_hand_over(self, path: Path) -> None:
        """``path``'s directory (a sandbox work directory) and ``path`` (the copy in it) go to the sandbox user."""

    def run_sandboxed(self, argv: list[str], cwd: Path, stdout_fd: int, *, timeout: float) -> tuple[int, bytes]:
        """``argv`` as the sandbox user in ``cwd``, its output into ``stdout_fd``: (exit status, stderr)."""

    def open_serial(self, domain: str, pty: Path) -> int:
        """A descriptor (read-write, non-blocking) on the serial console pty of ``domain``, one of this store's
        running libvirt domains, at ``pty`` as libvirt named it to the caller (the root helper asks libvirt
        itself, and opens only the pty it names)."""

    def connect_agent(self, path: Path, timeout: float) -> socket.socket:
        """A connection to the guest agent socket at ``path`` (``instances/NAME/agent.sock`` of a running
        capsule of this store: the root helper connects only to a channel socket libvirt names for its domain)."""


def _open_nofollow(path: Path, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


class Direct:
    """This process is root: the operations run in it (the caller is trusted as much as root is)."""

    def adopt_memory_image(self, path: Path) -> None:
        fd = _open_nofollow(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            home = Path(path).parent.parent
            hs = home.stat()
            if (st.st_uid, st.st_gid) != (hs.st_uid, hs.st_gid):
                ops.adopt_memory_image(fd, ops.Owner(hs.st_uid, hs.st_gid))
        finally:
            os.close(fd)

    def pod_bridge_up(self) -> str:
        return ops.pod_bridge_up()

    def sandbox_hand_over(self, path: Path) -> None:
        dfd = _open_nofollow(Path(path).parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            ffd = _open_nofollow(path, os.O_RDONLY)
            try:
                ops.sandbox_hand_over(dfd, ffd)
            finally:
                os.close(ffd)
        finally:
            os.close(dfd)

    def run_sandboxed(self, argv: list[str], cwd: Path, stdout_fd: int, *, timeout: float) -> tuple[int, bytes]:
        dfd = _open_nofollow(cwd, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return ops.run_sandboxed(argv, dfd, stdout_fd, timeout=timeout)
        finally:
            os.close(dfd)

    def open_serial(self, domain: str, pty: Path) -> int:
        return guestfiles.open_pty(pty)

    def connect_agent(self, path: Path, timeout: float) -> socket.socket:
        return guestfiles.connect_socket(path, "the guest agent's socket", timeout, root_too=True)


_current: Privileged = Direct()
_invoked_by: int | None = None     # the uid this process ran as before it dropped to the store's owner


def current() -> Privileged:
    """How this process does what needs root: :class:`Direct`, or its root helper after a drop."""
    return _current


def use(impl: Privileged, invoked_by: int | None = None) -> None:
    global _current, _invoked_by
    _current = impl
    _invoked_by = invoked_by


def invoked_by() -> int:
    """The uid that started this process (root, before it dropped to the store's owner); else its own."""
    return os.getuid() if _invoked_by is None else _invoked_by
