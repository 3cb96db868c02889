"""The compose hosts (docker-compose.yml) driven from this machine: by `make demo-compose` and by the
`hosts` test tier, each with a compose project (and loopback ports) of its own.

Each host is a container with its own root file system, store, libvirtd and agent. What happens *on* a
host runs there with that host's own CLI (``docker exec … capsule``); everything between hosts goes over
the network, agent to agent, with tokens."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
# Debian's client and compose (another `docker` may come first on PATH)
DOCKER = "/usr/bin/docker"
T = TypeVar("T")

# Run inside a host: a shell command in a guest, through the guest's serial console there.
_GUEST_SHELL = """
import sys
from capsule.console.serial import ConsoleSession
s = ConsoleSession(sys.argv[1])
try:
    print(s.run(sys.argv[2], timeout=float(sys.argv[3])))
finally:
    s.close()
"""

# Run inside a host: the guest's clock against the host's (testkit.guestclock), sampled over one console session
# so that a sample's round trip is the console's alone
_GUEST_OFFSET = """
import json, sys
from capsule.console.serial import ConsoleSession
from testkit import guestclock
s = ConsoleSession(sys.argv[1])
try:
    s.run("true", timeout=30)
    o = guestclock.offset(lambda cmd: s.run(cmd, timeout=30), samples=5)
    print(json.dumps([o.seconds, o.error]))
finally:
    s.close()
"""

# Run inside a host, as its store's owner (as the host's CLI runs): a function of testkit.desktop on a capsule of
# that store (read through the guest's own agent or its screen there), its answer as JSON
_DESKTOP = """
import json, sys
from capsule.privsep.drop import as_store_owner
from capsule.store import Store, default_home
as_store_owner(default_home().absolute())
from testkit import desktop
store = Store.open(default_home())
try:
    print(json.dumps(getattr(desktop, sys.argv[1])(store, sys.argv[2])))
finally:
    store.close()
"""


class ComposeError(Exception):
    """Something about the compose hosts went wrong (a command failed, a wait timed out)."""


class HostCommandFailed(ComposeError):
    def __init__(self, host: str, args: list[str], proc: subprocess.CompletedProcess[str]) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        super().__init__(f"{host}: `{' '.join(args)}` exited {proc.returncode}\n"
                         f"stdout: {proc.stdout.strip()}\nstderr: {proc.stderr.strip()}")


@dataclass(frozen=True)
class Project:
    """One set of compose hosts: the compose project's name and the agents' loopback addresses
    (``CAPSULE_HOST_A_LISTEN`` …; empty: docker-compose.yml's defaults, 7171 and 7172)."""

    name: str
    listen: dict[str, str] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        return os.environ | {"PATH": "/usr/bin:/usr/sbin:" + os.environ.get("PATH", ""),
                             "COMPOSE_PROJECT_NAME": self.name} | self.listen | extra

    def compose(self, *args: str, timeout: float = 300) -> str:
        proc = subprocess.run(["docker-compose", *compose_files(), *args], cwd=ROOT, env=self.env(),
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise HostCommandFailed("docker-compose", list(args), proc)
        return proc.stdout

    def up(self, *services: str, timeout: float = 1200, show: bool = False) -> None:
        """`make compose-up` (compose/up.sh): the base image if missing, the host image (cached), start,
        wait for the agents. ``show``: its progress goes to this process's stderr."""
        out = None if show else subprocess.PIPE
        proc = subprocess.run(["bash", str(ROOT / "compose" / "up.sh"), *services], cwd=ROOT, env=self.env(),
                              stdout=out, stderr=out, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise HostCommandFailed("compose/up.sh", list(services), proc)

    def host(self, service: str) -> Host:
        return Host(service, self)

    def object_store(self) -> tuple[str, dict[str, str]]:
        """The object store service's S3 endpoint (``s3+http://127.0.0.1:PORT``, for ``capsule repo`` URLs) and
        its S3 identity (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``)."""
        cid = self.compose("ps", "-q", "object-store").strip()
        if not cid:
            raise ComposeError(f"project {self.name} has no object-store container: run compose/up.sh")
        proc = subprocess.run([DOCKER, "exec", cid, "cat", "/var/lib/seaweedfs/credentials.json"],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise HostCommandFailed("object-store", ["cat", "credentials.json"], proc)
        port = self.listen.get("CAPSULE_S3_PORT") or "7180"
        return f"s3+http://127.0.0.1:{port}", json.loads(proc.stdout)


# `make compose-up`'s hosts (agents on 7171 and 7172, or CAPSULE_HOST_A_LISTEN/…_B_LISTEN; the object store's S3
# on 7180, or CAPSULE_S3_PORT): the demo's
DEMO = Project(os.environ.get("COMPOSE_PROJECT_NAME") or "capsule")
# The `hosts` test tier's: never the hosts of `make compose-up` or their stores (another run beside this one
# sets CAPSULE_TEST_COMPOSE_PROJECT and CAPSULE_TEST_HOST_A_LISTEN/…_B_LISTEN)
# (live moves cross in the agents' tunnel: no libvirtd or QEMU port of their own)
TEST = Project(os.environ.get("CAPSULE_TEST_COMPOSE_PROJECT") or "capsule-test",
               {"CAPSULE_HOST_A_LISTEN": os.environ.get("CAPSULE_TEST_HOST_A_LISTEN") or "127.0.0.1:7271",
                "CAPSULE_HOST_B_LISTEN": os.environ.get("CAPSULE_TEST_HOST_B_LISTEN") or "127.0.0.1:7272",
                "CAPSULE_S3_PORT": os.environ.get("CAPSULE_TEST_S3_PORT") or "7273"})


def compose_files() -> list[str]:
    files = ["-f", str(ROOT / "docker-compose.yml")]
    if os.path.exists("/dev/kvm"):
        files += ["-f", str(ROOT / "docker-compose.kvm.yml")]
    if os.path.exists("/dev/userfaultfd"):
        files += ["-f", str(ROOT / "docker-compose.uffd.yml")]
    return files


def docker_ready() -> str | None:
    """None if docker answers, else why not."""
    if not os.path.exists(DOCKER):
        return f"{DOCKER} is missing: run `make setup` (installs docker.io and docker-compose)"
    proc = subprocess.run([DOCKER, "info"], capture_output=True, text=True, timeout=60)
    return None if proc.returncode == 0 else f"docker does not answer: {proc.stderr.strip()[:300]}"


@dataclass
class Host:
    service: str     # compose service, e.g. host-a
    project: Project
    _container: str | None = None

    @property
    def container(self) -> str:
        """The id of the service's current container (a new one after remove() and start())."""
        if self._container is None:
            cid = self.project.compose("ps", "-q", self.service).strip()
            if not cid:
                raise ComposeError(f"{self.service} has no container (project {self.project.name}): "
                                   f"run `make compose-up`")
            self._container = cid
        return self._container

    def _exec(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 300,
              check: bool = True) -> subprocess.CompletedProcess[str]:
        # `-e NAME` without a value passes NAME from our environment: a token never shows on a command line
        cmd = [DOCKER, "exec", *(a for k in (env or {}) for a in ("-e", k)), self.container, *args]
        proc = subprocess.run(cmd, env=self.project.env(**(env or {})), capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise HostCommandFailed(self.service, args, proc)
        return proc

    def sh(self, script: str, timeout: float = 60) -> str:
        return self._exec(["sh", "-c", script], timeout=timeout).stdout

    @property
    def home(self) -> str:
        return self.sh('printf %s "$CAPSULE_HOME"')

    @property
    def url(self) -> str:
        return "http://" + self.sh('printf %s "$CAPSULE_LISTEN"')

    @property
    def token(self) -> str:
        return self.sh('cat "$CAPSULE_HOME/agent.token"').strip()

    def api(self, method: str, path: str, body: Any = None, timeout: float = 300) -> Any:
        """A call to this host's agent over the network (loopback), with its token."""
        import httpx

        r = httpx.request(method, self.url + path, json=body, timeout=timeout,
                          headers={"Authorization": f"Bearer {self.token}"})
        if r.status_code != 200:
            raise ComposeError(f"{self.service} {method} {path}: {r.status_code} {r.text}")
        return r.json()

    def capsule(self, *args: str, token: str | None = None, env: dict[str, str] | None = None,
                timeout: float = 300) -> Any:
        """This host's own CLI with --json; ``token`` is the peer agent's (CAPSULE_TOKEN)."""
        extra = dict(env or {})
        if token is not None:
            extra["CAPSULE_TOKEN"] = token
        out = self._exec(["capsule", "--json", *args], env=extra, timeout=timeout).stdout
        return json.loads(out) if out.strip() else None

    def capsule_background(self, *args: str, token: str | None = None) -> subprocess.Popen[str]:
        """This host's CLI with --json, without waiting for it."""
        extra = {"CAPSULE_TOKEN": token} if token is not None else {}
        return subprocess.Popen([DOCKER, "exec", *(a for k in extra for a in ("-e", k)), self.container,
                                 "capsule", "--json", *args], env=self.project.env(**extra),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def capsule_fails(self, *args: str, token: str | None = None, timeout: float = 300) -> HostCommandFailed:
        extra = {"CAPSULE_TOKEN": token} if token is not None else {}
        proc = self._exec(["capsule", *args], env=extra, timeout=timeout, check=False)
        if proc.returncode == 0:
            raise ComposeError(f"{self.service}: `capsule {' '.join(args)}` succeeded: {proc.stdout}")
        return HostCommandFailed(self.service, list(args), proc)

    def states(self) -> dict[str, dict[str, Any]]:
        """`capsule ls` on this host: each capsule's line by name."""
        return {c["name"]: c for c in self.capsule("ls")}

    def domain(self, name: str) -> str:
        states = self.states()
        if name not in states or not states[name]["domain"]:
            raise ComposeError(f"{name} is not running on {self.service}: {states}")
        return states[name]["domain"]

    def state(self, name: str) -> str | None:
        s = self.states().get(name)
        return s["state"] if s else None

    def domstate(self, name: str) -> str:
        """libvirt's state and reason, e.g. 'paused (I/O error)'."""
        return self.sh(f"virsh -c qemu:///system domstate --reason {self.domain(name)}").strip()

    def guest(self, name: str, command: str, timeout: float = 60) -> str:
        """Run a shell command in a guest running on this host; its output."""
        args = ["/opt/capsule/.venv/bin/python", "-c", _GUEST_SHELL, self.domain(name), command, str(timeout)]
        return self._exec(args, timeout=timeout + 30).stdout.strip()

    def desktop(self, what: str, name: str, timeout: float = 60) -> Any:
        """testkit.desktop's function ``what`` (e.g. ``typed_lines``) on capsule ``name`` of this host, run there."""
        args = ["/opt/capsule/.venv/bin/python", "-c", _DESKTOP, what, name]
        return json.loads(self._exec(args, timeout=timeout).stdout.strip().splitlines()[-1])

    def guest_offset(self, name: str) -> Any:
        """testkit.guestclock's offset of a guest running on this host (the hosts share this machine's clock)."""
        return self.domain_offset(self.domain(name))

    def domain_offset(self, domain: str) -> Any:
        """guest_offset() of a libvirt domain by its name (a guest this host's store does not know)."""
        from testkit.guestclock import Offset

        args = ["/opt/capsule/.venv/bin/python", "-c", _GUEST_OFFSET, domain]
        seconds, error = json.loads(self._exec(args, timeout=120).stdout.strip().splitlines()[-1])
        return Offset(seconds, error)

    def guest_background(self, name: str, command: str, timeout: float) -> subprocess.Popen[str]:
        """Like guest(), without waiting: the process ends when the command has run in the guest."""
        args = ["/opt/capsule/.venv/bin/python", "-c", _GUEST_SHELL, self.domain(name), command, str(timeout)]
        return subprocess.Popen([DOCKER, "exec", self.container, *args], env=self.project.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def disk_digest(self, name: str, blocks: int = 2048, timeout: float = 120) -> str:
        out = self.guest(name, f"echo 3 > /proc/sys/vm/drop_caches; "
                               f"dd if=/dev/vda bs=4096 count={blocks} 2>/dev/null | sha256sum", timeout=timeout)
        return out.split()[0]

    def running(self) -> bool:
        if not self.project.compose("ps", "-q", self.service).strip():
            return False
        proc = subprocess.run([DOCKER, "inspect", "-f", "{{.State.Running}}", self.container],
                              capture_output=True, text=True, timeout=60)
        return proc.stdout.strip() == "true"

    def stop(self) -> None:
        """The machine goes away (its store volume stays)."""
        self.project.compose("stop", "-t", "5", self.service)

    def remove(self) -> None:
        """The container is removed entirely: root file system, libvirtd, guests; only the volume stays."""
        self.project.compose("rm", "--stop", "--force", self.service)
        self._container = None

    def start(self) -> None:
        self.project.up(self.service)
        self._container = None


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.3) -> T:
    """Poll ``check()`` until it returns something true, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ComposeError(f"timed out after {timeout:.0f} s waiting for {what} (last: {value!r})")
        time.sleep(interval)
