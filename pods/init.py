"""A pod's init, PID 1 of the pod's PID namespace (Zap's pod root): waits for the network, makes the
mount namespace private (its own /proc, /sys, /tmp, /run, /dev/shm), names the host, starts the
pod's command and reaps every process of the pod until none is left."""

from __future__ import annotations

import contextlib
import os
import sys

from pods import sysops

KEEP = ("/", "/dev")
LOG = "/tmp/pod.log"


def mountpoints() -> list[str]:
    """This mount namespace's mount points, deepest first."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            points.append(point)
    return sorted(set(points), key=lambda p: -p.count("/"))


def private_mounts(hostname: str) -> None:
    sysops.mount("none", "/", None, sysops.MS_REC | sysops.MS_PRIVATE)
    for point in (p for p in mountpoints() if p not in KEEP):
        with contextlib.suppress(OSError):  # under one already detached
            sysops.umount_detach(point)
    sysops.mount("proc", "/proc", "proc", sysops.MS_NOSUID | sysops.MS_NODEV | sysops.MS_NOEXEC)
    sysops.mount("sysfs", "/sys", "sysfs", sysops.MS_NOSUID | sysops.MS_NODEV | sysops.MS_NOEXEC)
    sysops.mount("tmpfs", "/tmp", "tmpfs", sysops.MS_NOSUID | sysops.MS_NODEV, "mode=1777")
    sysops.mount("tmpfs", "/run", "tmpfs", sysops.MS_NOSUID | sysops.MS_NODEV, "mode=755")
    os.makedirs("/dev/shm", exist_ok=True)
    sysops.mount("tmpfs", "/dev/shm", "tmpfs", sysops.MS_NOSUID | sysops.MS_NODEV, "mode=1777")
    sysops.sethostname(hostname)


def main(argv: list[str]) -> int:
    go_fd, hostname, cmd = int(argv[0]), argv[1], argv[2:]
    with os.fdopen(go_fd, "rb") as go:
        if go.read() != b"go":
            return 1  # the creator gave up
    os.setsid()  # the pod's sessions start inside it (CRIU dumps no session led from outside)
    private_mounts(hostname)
    sysops.set_comm("pod-init")
    log = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir("/")
    main_pid = os.fork()
    if main_pid == 0:
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            print(f"pod: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
            os._exit(127)
    status = 0
    while True:
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            return status
        except InterruptedError:
            continue
        if pid == main_pid:
            status = os.waitstatus_to_exitcode(raw)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
