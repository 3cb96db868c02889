"""Parse what a guest controls without privileges: a tool run as the ``capsule-sandbox`` user.

A guest writes its own file systems, so a tool that reads one (``e2fsck``, ``debugfs``) reads hostile input.
Run as root, a bug in it would be a way out of the guest. Here such a tool runs through ``setpriv`` as the
unprivileged system user ``capsule-sandbox`` (created by ``scripts/setup-host.sh``; it owns nothing and belongs
to no other group) with no capabilities — none inheritable, an empty bounding set — and ``no_new_privs``
(a set-uid program cannot give them back). The environment is reduced to ``PATH`` and ``LANG``. Switching to that
user needs root: an agent that gave up root asks its root helper (:mod:`capsule.privsep`), which runs only
``e2fsck`` and ``debugfs`` this way.

What it may read is handed to it one file at a time: a private copy owned by that user, in a work directory
of its own (the store owner's, group ``capsule-sandbox``, 0710) that the tool starts in — the store's
directories above stay closed to it (0700), so the tool reaches the copy and nothing else of the store.
Whatever it produces comes back on its standard output, into a file the caller opened: no file the
sandboxed tool could have replaced (by a symbolic link, say) is ever opened by the privileged caller."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from capsule.errors import EnvironmentProblem

USER = "capsule-sandbox"
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


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
    """A fresh private directory in ``parent`` (this process's, 0700) for one copy to hand over; removed with what
    is in it afterwards. :func:`hand_over` lets the sandbox user enter it (group ``capsule-sandbox``, 0710)."""
    path = parent / f"{uuid.uuid4().hex}.sandbox"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def hand_over(path: Path) -> None:
    """Give the sandbox user ``path`` — a private copy made for it in a :func:`workdir` — to read and write (0600,
    its own), and let it enter the work directory; root's part (:mod:`capsule.privsep`)."""
    from capsule import privsep

    privsep.current().sandbox_hand_over(path)


def run(argv: list[str], cwd: Path, *, timeout: float, stdout: IO[bytes] | int = subprocess.PIPE,
        text: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` as the sandbox user, starting in ``cwd`` (a :func:`workdir`); stderr is captured. Root starts
    it (:mod:`capsule.privsep`: here, or the root helper of an agent that gave up root)."""
    from capsule import privsep

    def decode(data: bytes) -> str | bytes:
        return data.decode(errors="surrogateescape") if text else data

    if stdout == subprocess.PIPE:
        with tempfile.TemporaryFile(dir=cwd.parent) as out:
            status, err = privsep.current().run_sandboxed(argv, cwd, out.fileno(), timeout=timeout)
            out.seek(0)
            output: str | bytes | None = decode(out.read())
    else:
        fd = stdout if isinstance(stdout, int) else stdout.fileno()
        if not isinstance(stdout, int):
            stdout.flush()
        status, err = privsep.current().run_sandboxed(argv, cwd, fd, timeout=timeout)
        output = None
    return subprocess.CompletedProcess(argv, status, output, decode(err))
