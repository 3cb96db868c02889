"""Giving up root for a store's owner, keeping a root helper for the fixed command set (:mod:`.helper`).

``capsule serve --user USER`` and the CLI run by root on a store another user owns call :func:`drop_to` before
they open the store: it starts the helper (as root, sharing only a socket pair), then sets this process's
groups (USER's), gid and uid, empties its capability bounding set, sets ``no_new_privs`` and checks in
``/proc/self/status`` that no capability is left. From then on :func:`capsule.privsep.current` is the helper."""

from __future__ import annotations

import ctypes
import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path

from capsule import privsep
from capsule.errors import EnvironmentProblem
from capsule.privsep.helper import HelperClient

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
_CAPS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
_helper: subprocess.Popen | None = None


def user_entry(name: str) -> pwd.struct_passwd:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise EnvironmentProblem(f"no user {name!r} on this host: `make setup` (scripts/setup-host.sh) creates "
                                 "the capsule user") from None
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise EnvironmentProblem(f"--user {name}: that is root (uid {pw.pw_uid}, gid {pw.pw_gid}); give the "
                                 "unprivileged user the agent runs as, e.g. capsule")
    return pw


def check_store_owned(home: Path, pw: pwd.struct_passwd) -> None:
    """Refuse a store that is not ``pw``'s: the store directory and everything directly in it."""
    strangers = [p for p in (home, *sorted(home.iterdir())) if p.lstat().st_uid != pw.pw_uid]
    if strangers:
        names = ", ".join(str(p) for p in strangers[:3]) + (" …" if len(strangers) > 3 else "")
        raise EnvironmentProblem(f"the store {home} is not owned by {pw.pw_name} ({names}): as root, "
                                 f"`chown -R {pw.pw_name}: {home}` gives it to that user, then start again")


def _status() -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":\t" in line)


def unprivileged(uid: int, gid: int) -> None:
    """Raise unless this process is ``uid``/``gid`` with no capability in any set (its bounding set too)."""
    st = _status()
    ids = (st["Uid"].split(), st["Gid"].split())
    left = [c for c in _CAPS if int(st.get(c, "0"), 16)]
    if ids != ([str(uid)] * 4, [str(gid)] * 4) or left:
        raise EnvironmentProblem(f"dropping privileges failed: uid {st['Uid']}, gid {st['Gid']}, "
                                 f"capabilities left in {', '.join(left) or 'none'}")


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        raise EnvironmentProblem(f"prctl({option}, {arg}): {os.strerror(ctypes.get_errno())}")


def drop_to(name: str, home: Path) -> None:
    """Start the root helper for the store ``home``, then become the user ``name`` for good."""
    global _helper
    if os.geteuid() != 0:
        raise EnvironmentProblem(f"--user {name}: only root can switch to another user; start it as root "
                                 "(or leave --user out to run as yourself)")
    pw = user_entry(name)
    home = Path(os.path.realpath(home))
    if not home.exists():   # a new store: its directory is the user's from the start
        home.parent.mkdir(parents=True, exist_ok=True)
        home.mkdir(mode=0o700)
        os.chown(home, pw.pw_uid, pw.pw_gid)
    check_store_owned(home, pw)
    _tunnel_dir(pw)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with theirs:
        _helper = subprocess.Popen([sys.executable, "-m", "capsule.privsep.helper", str(theirs.fileno()),
                                    str(home), str(pw.pw_uid), str(pw.pw_gid)],
                                   pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    os.setgroups(os.getgrouplist(pw.pw_name, pw.pw_gid))
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)
    os.setresgid(pw.pw_gid, pw.pw_gid, pw.pw_gid)
    os.setresuid(pw.pw_uid, pw.pw_uid, pw.pw_uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    unprivileged(pw.pw_uid, pw.pw_gid)
    os.environ.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name, CAPSULE_HOME=str(home))
    os.environ.setdefault("CAPSULE_LIBVIRT_URI", "qemu:///system")   # root's libvirt, not a session of USER's
    privsep.use(HelperClient(ours), invoked_by=0)


def _tunnel_dir(pw: pwd.struct_passwd) -> None:
    """The tunnel's directory (``/run/capsule/tunnel``, ``CAPSULE_TUNNEL_DIR``) made the user's while still root:
    the agent makes each tunnel session's directory there (live moves), the user cannot make it under ``/run``."""
    from capsule.exchange.tunnel import TUNNEL_DIR, TUNNEL_DIR_ENV

    d = Path(os.environ.get(TUNNEL_DIR_ENV) or TUNNEL_DIR)
    try:
        d.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        d.mkdir(mode=0o711, exist_ok=True)
        if d.is_symlink() or not d.is_dir():
            raise EnvironmentProblem(f"the tunnel directory {d} is not a directory: remove it and start again")
        os.chown(d, pw.pw_uid, pw.pw_gid, follow_symlinks=False)
        os.chmod(d, 0o711)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot make the tunnel directory {d} for {pw.pw_name}: {exc}") from exc


def helper_pid() -> int | None:
    """The root helper's process id, once this process dropped to a user."""
    return _helper.pid if _helper is not None else None


def as_store_owner(home: Path) -> str | None:
    """The CLI run by root on a store another user owns becomes that user (with the helper) for the whole
    command, so it leaves no root-owned file that user's agent could not read. The user's name, or None."""
    if os.geteuid() != 0 or not home.is_dir():
        return None
    uid = home.stat().st_uid
    if uid == 0:
        return None
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        raise EnvironmentProblem(f"the store {home} is owned by uid {uid}, which is no user here: "
                                 f"`chown -R USER: {home}` (e.g. capsule, or root)") from None
    drop_to(name, home)
    return name


def serve_as(name: str, home: Path) -> None:
    """``capsule serve --user NAME``: drop to NAME, or check that this process already is NAME (the CLI
    dropped to the store's owner before)."""
    pw = user_entry(name)
    if os.geteuid() == 0:
        drop_to(name, home)
    elif privsep.invoked_by() == 0 and os.geteuid() != pw.pw_uid:   # root's CLI already became the store's owner
        check_store_owned(Path(os.path.realpath(home)), pw)
    elif os.geteuid() != pw.pw_uid or privsep.invoked_by() != 0:
        raise EnvironmentProblem(f"--user {name}: only root can switch to another user; start it as root "
                                 "(or leave --user out to run as yourself)")
    else:
        check_store_owned(Path(os.path.realpath(home)), pw)
