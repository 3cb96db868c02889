"""Parse what a guest controls without privileges: a tool run as the ``capsule-sandbox`` user.

A guest writes its own file systems, so a tool that reads one (``e2fsck``, ``debugfs``) reads hostile input.
Run as root, a bug in it would be a way out of the guest. Here such a tool runs through ``setpriv`` as the
unprivileged system user ``capsule-sandbox`` (created by ``scripts/setup-host.sh``; it owns nothing and belongs
to no other group) with no capabilities — none inheritable, an empty bounding set — and ``no_new_privs``
(a set-uid program cannot give them back). The environment is reduced to ``PATH`` and ``LANG``.

What it may read is handed to it one file at a time: a private copy owned by that user, in a work directory
of its own (``root:capsule-sandbox``, 0710) that the tool starts in — the store's directories above stay
closed to it (0700), so the tool reaches the copy and nothing else of the store. Whatever it produces comes
back on its standard output, into a file the caller opened: no file the sandboxed tool could have replaced
(by a symbolic link, say) is ever opened by the privileged caller."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from capsule.errors import EnvironmentProblem

USER = "capsule-sandbox"
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def ids() -> tuple[int, int]:
    """(uid, gid) of the sandbox user; a clear error where the host was not set up for it."""
    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        raise EnvironmentProblem(f"the unprivileged user {USER}, which reads guest file systems, does not exist: "
                                 "run `make setup` (scripts/setup-host.sh creates it)") from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise EnvironmentProblem(f"the user {USER} must not be root (uid {entry.pw_uid}, gid {entry.pw_gid})")
    return entry.pw_uid, entry.pw_gid


def _setpriv() -> str:
    if os.geteuid() != 0:
        raise EnvironmentProblem(f"reading a guest's file system runs its tools as the unprivileged user {USER}; "
                                 "switching to that user needs root: run this command as root")
    path = shutil.which("setpriv")
    if path is None:
        raise EnvironmentProblem("setpriv (util-linux) is not installed; run `make setup`")
    return path


def command(argv: list[str]) -> list[str]:
    """``argv`` (its program found on the caller's PATH) as the sandbox user with no capabilities."""
    uid, gid = ids()
    program = shutil.which(argv[0])
    if program is None:
        raise EnvironmentProblem(f"{argv[0]} is not installed; run `make setup`")
    return [_setpriv(), f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--", program, *argv[1:]]


@contextmanager
def workdir(parent: Path) -> Iterator[Path]:
    """A fresh directory in ``parent`` that the sandbox user may enter but not change (root-owned, group
    ``capsule-sandbox``, 0710); removed with what is in it afterwards."""
    _, gid = ids()
    path = parent / f"{uuid.uuid4().hex}.sandbox"
    path.mkdir(mode=0o700)
    try:
        os.chown(path, 0, gid)
        os.chmod(path, 0o710)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def hand_over(path: Path) -> None:
    """Give the sandbox user ``path`` — a private copy made for it — to read and write (0600, its own)."""
    uid, gid = ids()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def run(argv: list[str], cwd: Path, *, timeout: float, stdout: IO[bytes] | int = subprocess.PIPE,
        text: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` as the sandbox user, starting in ``cwd`` (a :func:`workdir`); stderr is captured."""
    return subprocess.run(command(argv), cwd=cwd, env=_ENV, stdin=subprocess.DEVNULL, stdout=stdout,
                          stderr=subprocess.PIPE, text=text, errors="surrogateescape" if text else None,
                          timeout=timeout, check=False)
