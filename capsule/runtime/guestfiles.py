"""Opening what a guest's QEMU made on this host: its screen's VNC socket in the instance directory, its serial
console's pty. The agent (root) opens them for the page; QEMU runs as the guest user
(:mod:`capsule.runtime.guestaccess`) and may be in an attacker's hands. It can put a symbolic link where its
socket was (say, to libvirt's root socket), hard-link another socket there, or have libvirt report another pty.

So the node is opened without following a link (``O_PATH | O_NOFOLLOW``), checked on that descriptor — a
socket, or a pty (a character device of the pty slaves' majors under /dev/pts/), owned by the guest user (root
only where QEMU runs as root) — and then connected or opened through the descriptor (``/proc/self/fd/N``), so
nothing can be swapped in between the check and the use. Anything else is :class:`GuestFileRefused`."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from capsule.errors import Conflict
from capsule.runtime.guestaccess import GuestUser, guest_user

PTY_DIR = "/dev/pts/"
PTY_MAJORS = range(136, 144)   # Unix98 pty slaves (Documentation/admin-guide/devices.txt)


class GuestFileRefused(Conflict):
    """A socket or pty the guest's QEMU made is not what it should be (a link, another kind of file, another
    owner): it is not opened."""

    code = "guest_file_refused"


def _node(path: Path, what: str) -> tuple[int, os.stat_result]:
    """An ``O_PATH`` descriptor on ``path`` itself (a link is not followed) and its status."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            raise GuestFileRefused(f"{what} {path} is a symbolic link, not the node QEMU makes; refused")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def check_owner(st: os.stat_result, path: Path, what: str, user: GuestUser | None = None, *,
                root_too: bool = False) -> None:
    """GuestFileRefused unless the guest user (or, with ``root_too``, root) owns the node ``st`` describes."""
    user = user or guest_user()
    if st.st_uid != user.uid and not (root_too and st.st_uid == 0):
        raise GuestFileRefused(f"{what} {path} belongs to uid {st.st_uid}, not to {user.name} (uid {user.uid}) "
                               f"that QEMU runs as{' (or root)' if root_too else ''}; refused")


def check_socket(path: Path, what: str = "the socket", user: GuestUser | None = None) -> None:
    """GuestFileRefused unless ``path`` is a socket (not a link to one) the guest user owns;
    FileNotFoundError when there is nothing there."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise GuestFileRefused(f"{what} {path} is a symbolic link, not the node QEMU makes; refused")
    if not stat.S_ISSOCK(st.st_mode):
        raise GuestFileRefused(f"{what} {path} is not a socket; refused")
    check_owner(st, path, what, user)


def connect_socket(path: Path, what: str = "the socket", timeout: float = 5.0, user: GuestUser | None = None,
                   *, root_too: bool = False) -> socket.socket:
    """A connected unix stream socket to the guest's socket at ``path``: checked as :func:`check_socket` on the
    node itself, then connected through its descriptor. ``root_too``: a socket root made is taken too (libvirt
    makes a channel's socket and hands QEMU the descriptor). OSError (FileNotFoundError,
    ConnectionRefusedError) when nothing listens there."""
    fd, st = _node(path, what)
    try:
        if not stat.S_ISSOCK(st.st_mode):
            raise GuestFileRefused(f"{what} {path} is not a socket; refused")
        check_owner(st, path, what, user, root_too=root_too)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(f"/proc/self/fd/{fd}")
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(fd)


def open_pty(path: Path, what: str = "the serial console", user: GuestUser | None = None) -> int:
    """A descriptor (read-write, non-blocking, not a controlling terminal) on the guest's pty at ``path``: a pty
    slave under /dev/pts/ the guest user owns, checked on the node itself and opened through its descriptor."""
    if not str(path).startswith(PTY_DIR) or "/" in str(path)[len(PTY_DIR):]:
        raise GuestFileRefused(f"{what} {path} is not a pty under {PTY_DIR}; refused")
    fd, st = _node(path, what)
    try:
        if not stat.S_ISCHR(st.st_mode) or os.major(st.st_rdev) not in PTY_MAJORS:
            raise GuestFileRefused(f"{what} {path} is not a pty; refused")
        check_owner(st, path, what, user)
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    finally:
        os.close(fd)
