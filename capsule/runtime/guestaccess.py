"""Who QEMU runs as, and the files that user may open.

libvirt starts every capsule's QEMU as an unprivileged user, by default Debian's ``libvirt-qemu``. The domain XML
names it in a static DAC label with relabelling off (:func:`seclabel`), so libvirt changes the owner of no file.
Instead the store lets that user's group (``GROUP``, the group of the same name) reach exactly what a guest needs,
when the guest starts (:func:`grant_machine`), a disk is lent to it (:func:`lend`) or a disk server serves it:

- the store directory and its ``layers/``, ``files/`` and ``instances/``: 0710 root:GROUP. QEMU may pass through
  them but not list them.
- The kernel, the initrd and each layer of the guest's chains: group GROUP, read-only (sealed objects are 0440).
- The guest's own leaves: 0660 root:GROUP. These are the only store files it may write.
- Its instance directory: 01770 root:GROUP. QEMU makes the screen's socket there. The sticky bit keeps it from
  removing or renaming anything it did not make.
- A disk server's socket: 0660 root:GROUP.

Memory images stay 0400 root. libvirtd (root) reads and writes them and gives QEMU a pipe or a file descriptor.
Everything else in the store stays root's alone: ``tmp/``, ``recv/``, ``shadows/``, ``remote/``, the catalogue
and the audit log.

Every directory above the store must let GROUP pass (``o+x``). :func:`check_reachable` names the first one that
does not and says how to fix it. ``CAPSULE_QEMU_USER=root`` restores the old way, with QEMU as root and no
confinement.
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import stat
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from capsule.errors import EnvironmentProblem, IntegrityError
from capsule.store.modes import GUEST_DIR_MODE, GUEST_SUBDIRS

USER_ENV = "CAPSULE_QEMU_USER"
DEFAULT_USER = "libvirt-qemu"
INSTANCE_DIR_MODE = 0o1770   # an instance's directory: QEMU may add its sockets, not touch the rest
_MAX_CHAIN = 256             # a backing chain longer than this is a loop or an attack


@dataclass(frozen=True)
class GuestUser:
    name: str
    uid: int
    gid: int

    @property
    def unconfined(self) -> bool:
        return self.uid == 0

    @property
    def label(self) -> str:
        return f"+{self.uid}:+{self.gid}"


@functools.cache
def guest_user() -> GuestUser:
    """The user QEMU runs as: ``CAPSULE_QEMU_USER``, else ``libvirt-qemu``, with the group of its own name
    (else its primary group). Root when the default user does not exist here (no libvirt-daemon-system)."""
    name = os.environ.get(USER_ENV) or DEFAULT_USER
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        if name != DEFAULT_USER:
            raise EnvironmentProblem(f"{USER_ENV}={name}: no such user on this host") from None
        return GuestUser("root", 0, 0)
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        gid = pw.pw_gid
    return GuestUser(name, pw.pw_uid, gid)


def socket_group() -> int | None:
    """The group a socket QEMU connects to must have (a disk server's); None when QEMU runs as root."""
    user = guest_user()
    return None if user.unconfined else user.gid


def seclabel(user: GuestUser | None = None) -> ET.Element:
    """``<seclabel>``: QEMU runs as the guest user; libvirt relabels nothing (the store grants access)."""
    user = user or guest_user()
    el = ET.Element("seclabel", type="static", model="dac", relabel="no")
    ET.SubElement(el, "label").text = user.label
    return el


def _group(path: Path, gid: int, mode: int) -> None:
    st = path.stat()
    if st.st_gid != gid:
        os.chown(path, -1, gid)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def _allow_read(path: Path, gid: int, *, write: bool = False) -> None:
    """``path`` readable (and, with ``write``, writable) by group ``gid``, its owner's bits kept."""
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    want = mode | stat.S_IRGRP | (stat.S_IWGRP if write else 0)
    if st.st_gid != gid:
        os.chown(path, -1, gid)
    if want != mode:
        os.chmod(path, want)


def check_reachable(path: Path, user: GuestUser | None = None) -> None:
    """Raise :class:`EnvironmentProblem` unless the guest user may pass through every directory above ``path``."""
    user = user or guest_user()
    if user.unconfined:
        return
    for d in reversed(Path(path).absolute().parents):
        st = d.stat()
        if st.st_mode & stat.S_IXOTH or (st.st_gid == user.gid and st.st_mode & stat.S_IXGRP) \
                or (st.st_uid == user.uid and st.st_mode & stat.S_IXUSR):
            continue
        raise EnvironmentProblem(
            f"QEMU runs as {user.name} and cannot reach {path}: {d} (mode {stat.S_IMODE(st.st_mode):04o}) does "
            f"not let it pass. Keep stores where it can (CAPSULE_HOME=/var/lib/capsule), or `chmod o+x {d}`")


def grant_store(home: Path, user: GuestUser | None = None) -> None:
    """The store directory and the directories guests open files in: 0710 root:GROUP."""
    user = user or guest_user()
    if user.unconfined:
        return
    check_reachable(home, user)
    _group(home, user.gid, GUEST_DIR_MODE)
    for sub in GUEST_SUBDIRS:
        if (home / sub).is_dir():
            _group(home / sub, user.gid, GUEST_DIR_MODE)


def backing_chain(leaf: Path) -> list[Path]:
    """The local files below ``leaf`` in its qcow2 backing chain, nearest first (a network backing ends it; so
    does a backing file that is not there).

    A leaf's header is QEMU's to write, and so is a sealed layer's, once its leaf was sealed. So every backing
    file named must be, links resolved, a ``.qcow2`` file in ``leaf``'s own directory (the store's ``layers/``,
    where a layer names its parent by its bare name). A header naming anything else — ``/etc/shadow``,
    ``../files/<a memory image>``, a link out of the store — is refused with IntegrityError."""
    from hashcache.qcow2 import Qcow2Image

    home = leaf.parent.resolve()
    chain: list[Path] = []
    path = leaf
    while len(chain) < _MAX_CHAIN:
        with Qcow2Image(path) as img:
            name = img.backing_file
        if not name or "://" in name or name.startswith(("nbd:", "json:")):
            return chain
        real = (path.parent / name).resolve()
        if real.parent != home or real.suffix != ".qcow2" or real.exists() and not stat.S_ISREG(real.stat().st_mode):
            raise IntegrityError(f"{path.name} names {name!r} as its backing file, which is not a layer in {home}; "
                                 "refused (a header QEMU wrote is not trusted): nothing was granted to the guest")
        if not real.exists():
            return chain
        chain.append(real)
        path = real
    raise EnvironmentProblem(f"the backing chain of {leaf} is longer than {_MAX_CHAIN} layers")


def checked_chain(leaf: Path, known: list[Path] | None = None) -> list[Path]:
    """:func:`backing_chain`, each file in it also one of ``known`` (the layers the catalogue lists for this disk,
    where the caller knows them): what the header says never adds a file to what the guest is granted."""
    chain = backing_chain(leaf)
    if known is not None:
        allowed = {p.resolve() for p in known}
        for layer in chain:
            if layer not in allowed:
                raise IntegrityError(f"{leaf.name}'s backing chain names {layer.name}, which is not a layer of its "
                                     "disk in the catalogue; refused: nothing was granted to the guest")
    return chain


def grant_machine(store_home: Path, *, kernel: Path, initrd: Path, leaves: list[Path], instance_dir: Path,
                  sockets: list[Path] | tuple[Path, ...] = (), user: GuestUser | None = None,
                  chains: list[list[Path]] | None = None) -> None:
    """Everything a guest's QEMU opens, before libvirt starts it: the store's directories, the instance
    directory, the kernel and initrd, each leaf (read-write) and the layers below it (read-only).
    ``chains``: for each leaf, the layer files the catalogue lists below it; a backing chain naming another file
    (:func:`checked_chain`, :func:`backing_chain`) is refused before anything is granted."""
    user = user or guest_user()
    if user.unconfined:
        return
    below = [checked_chain(leaf, chains[i] if chains is not None else None) for i, leaf in enumerate(leaves)]
    grant_store(store_home, user)
    _group(instance_dir, user.gid, INSTANCE_DIR_MODE)
    for path in (kernel, initrd):
        _allow_read(path, user.gid)
    for leaf, layers in zip(leaves, below, strict=True):
        _allow_read(leaf, user.gid, write=True)
        for layer in layers:
            _allow_read(layer, user.gid)
    for sock in sockets:
        _allow_read(sock, user.gid, write=True)


def lend(path: Path, *, writable: bool, user: GuestUser | None = None) -> None:
    """A file lent to a running guest as a disk: reachable, and readable (or writable) by the guest user."""
    user = user or guest_user()
    if user.unconfined:
        return
    check_reachable(path, user)
    _allow_read(path, user.gid, write=writable)


def let_pass(path: Path, top: Path) -> None:
    """``chmod o+x`` (pass through, never list) ``path`` and every directory between it and ``top``: for a work
    directory made private by ``mkdtemp`` (a test's, a benchmark's) that stores guests are run from live in."""
    path, top = Path(path).absolute(), Path(top).absolute()
    if path != top and top not in path.parents:
        raise ValueError(f"{path} is not under {top}")
    for d in (path, *path.parents):
        if d == top:
            return
        mode = stat.S_IMODE(d.stat().st_mode)
        if not mode & stat.S_IXOTH:
            os.chmod(d, mode | stat.S_IXOTH)
