"""The root helper of an unprivileged agent: a fixed command set over a socket pair, every path checked.

``capsule serve --user USER`` starts this helper as root before it drops to USER (:mod:`capsule.privsep.drop`);
the two share one ``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair and nothing else. Each request is one JSON message
of at most :data:`MAX_REQUEST` bytes — ``{"op": NAME, "path": …}`` — with descriptors attached (``SCM_RIGHTS``):
first a socket for its answer, then those the operation writes to; each answer is one JSON message on that socket,
``{"ok": true, …}`` or ``{"ok": false, "code": …, "error": …}``. Requests run side by side. The commands (nothing
else is run):

- ``adopt-memory-image PATH``: a new memory image in the store's ``tmp/`` becomes the store owner's.
- ``pod-bridge-up``: the host's pod bridge exists and is up.
- ``sandbox-hand-over PATH``: a private copy in a sandbox work directory in ``tmp/`` goes to the sandbox user.
- ``run-sandboxed TOOL ARGS CWD`` (TOOL: ``e2fsck`` or ``debugfs``), its standard output into the attached
  descriptor: the tool runs as the sandbox user with no capabilities (:mod:`capsule.sandbox`).
- ``open-serial DOMAIN``: the serial console pty of one of this store's running domains (``capsule-ID-NAME``,
  ID this store's), opened and its descriptor attached to the answer: QEMU's user owns the pty (mode 0620).
- ``connect-agent PATH``: a connection to the guest agent of one of this store's running domains, through its
  channel socket ``instances/NAME/agent.sock`` in the store, which libvirt must name in the domain's definition;
  the connected socket is attached to the answer: libvirt makes that socket root's.

A path must be absolute, without ``..``, and lie in the store's ``tmp/``; it is opened one component at a
time relative to the store, never following a symbolic link, so neither a link nor a later swap leads out of
the store. The helper exits when the agent closes its end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import sys
import threading
from pathlib import Path
from typing import Any

from capsule.errors import Conflict, EnvironmentProblem, Error, InvalidInput, NotFound, RuntimeFailure
from capsule.names import check_name
from capsule.privsep import ops
from capsule.runtime.guestfiles import GuestFileRefused

MAX_REQUEST = 64 * 1024
MAX_REPLY = 4 << 20
MAX_FDS = 1                  # besides the answer's socket
FDS = "_fds"                 # (an operation's answer) descriptors sent with it, then closed here
MAX_CONCURRENT = 8
SANDBOX_TOOLS = frozenset({"e2fsck", "debugfs"})
MAX_ARGS = 16
MAX_TIMEOUT = 3600.0
MAX_CONNECT_TIMEOUT = 60.0
AGENT_SOCKET = "agent.sock"  # a capsule's guest agent channel in its instance directory (libvirt makes it)
_ERRORS: dict[str, type[Error]] = {c.code: c for c in (InvalidInput, NotFound, EnvironmentProblem,
                                                               RuntimeFailure, Conflict, GuestFileRefused)}
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Helper:
    """The command set for one store (``home``, owned by ``owner``), with every path checked."""

    def __init__(self, home: Path, owner: ops.Owner) -> None:
        self.home = Path(os.path.realpath(home))
        self.owner = owner

    def _parts(self, path: object) -> list[str]:
        """``path``'s components below the store, checked: absolute, no ``..``, in the store's tmp/."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise InvalidInput("the helper takes a path as a non-empty string")
        if not path.startswith("/"):
            raise InvalidInput(f"{path!r} is not an absolute path")
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise InvalidInput(f"{path!r} holds `..`: give the path itself")
        home = [p for p in str(self.home).split("/") if p]
        if parts[:len(home)] != home or len(parts) < len(home) + 2 or parts[len(home)] != "tmp":
            raise InvalidInput(f"{path!r} is not in the store's tmp/ ({self.home}/tmp): the helper touches "
                               "nothing else")
        return parts[len(home):]

    def _open(self, parts: list[str], flags: int) -> int:
        """``parts`` below the store opened component by component, no symbolic link followed."""
        fd = os.open(self.home, _DIR)
        try:
            for i, name in enumerate(parts):
                last = i == len(parts) - 1
                try:
                    nfd = os.open(name, (flags | os.O_NOFOLLOW | os.O_CLOEXEC) if last else _DIR, dir_fd=fd)
                except FileNotFoundError:
                    raise NotFound(f"{'/'.join(parts[:i + 1])} does not exist in the store") from None
                except OSError as exc:   # ELOOP/ENOTDIR: a symbolic link, or not a directory where one must be
                    raise InvalidInput(f"{'/'.join(parts[:i + 1])} in the store is a symbolic link or not what "
                                       f"it should be ({exc.strerror}): refused") from None
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _regular(self, path: object) -> int:
        fd = self._open(self._parts(path), os.O_RDONLY)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise InvalidInput(f"{path} is not a regular file")
        return fd

    def adopt_memory_image(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        path = req.get("path")
        parts = self._parts(path)
        if len(parts) != 2 or not parts[1].endswith(".save"):
            raise InvalidInput(f"{path!r} is not a new memory image (tmp/NAME.save)")
        fd = self._regular(path)
        try:
            ops.adopt_memory_image(fd, self.owner)
        finally:
            os.close(fd)
        return {}

    def pod_bridge_up(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        return {"bridge": ops.pod_bridge_up()}

    def _workdir(self, path: object) -> list[str]:
        parts = self._parts(path)
        if len(parts) < 2 or not parts[1].endswith(".sandbox"):
            raise InvalidInput(f"{path!r} is not in a sandbox work directory (tmp/NAME.sandbox)")
        return parts

    def sandbox_hand_over(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        path = req.get("path")
        parts = self._workdir(path)
        if len(parts) != 3:
            raise InvalidInput(f"{path!r} is not a file directly in a sandbox work directory")
        dfd = self._open(parts[:2], os.O_RDONLY | os.O_DIRECTORY)
        try:
            if os.fstat(dfd).st_uid != self.owner.uid:
                raise InvalidInput(f"{path!r}: its work directory is not the store owner's")
            ffd = self._regular(path)
            try:
                ops.sandbox_hand_over(dfd, ffd)
            finally:
                os.close(ffd)
        finally:
            os.close(dfd)
        return {}

    def run_sandboxed(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        argv, cwd, timeout = req.get("argv"), req.get("cwd"), req.get("timeout", 600)
        if not isinstance(argv, list) or not argv or len(argv) > MAX_ARGS \
                or not all(isinstance(a, str) and "\0" not in a for a in argv):
            raise InvalidInput(f"run-sandboxed takes a tool and up to {MAX_ARGS - 1} string arguments")
        if argv[0] not in SANDBOX_TOOLS:
            raise InvalidInput(f"run-sandboxed runs {' or '.join(sorted(SANDBOX_TOOLS))} only, not {argv[0]!r}")
        if not isinstance(timeout, int | float) or not 0 < timeout <= MAX_TIMEOUT:
            raise InvalidInput(f"run-sandboxed: a timeout of up to {MAX_TIMEOUT:.0f} s")
        if len(fds) != 1:
            raise InvalidInput("run-sandboxed needs the descriptor its output goes to")
        parts = self._workdir(cwd)
        if len(parts) != 2:
            raise InvalidInput(f"{cwd!r} is not a sandbox work directory (tmp/NAME.sandbox)")
        dfd = self._open(parts, os.O_RDONLY | os.O_DIRECTORY)
        try:
            status, stderr = ops.run_sandboxed(argv, dfd, fds[0], timeout=float(timeout))
        finally:
            os.close(dfd)
        return {"status": status, "stderr": stderr.decode("utf-8", "surrogateescape")}

    def _domain(self, name: str) -> str:
        """The libvirt domain of this store's capsule ``name`` (``capsule-ID-NAME``)."""
        try:
            store_id = json.loads((self.home / "store.json").read_text())["id"]
        except (OSError, ValueError, KeyError, TypeError):
            raise NotFound(f"{self.home} holds no readable store.json") from None
        return f"capsule-{store_id}-{name}"

    def open_serial(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        domain = req.get("domain")
        prefix = self._domain("")
        try:
            ours = isinstance(domain, str) and domain.startswith(prefix) and bool(check_name(domain[len(prefix):]))
        except Error:
            ours = False
        if not ours:
            raise InvalidInput(f"{str(domain)[:80]!r} is not a domain of this store ({prefix}NAME): the helper "
                               "opens this store's consoles only")
        return {FDS: [ops.open_serial(str(domain))]}

    def connect_agent(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        path, timeout = req.get("path"), req.get("timeout")
        where = self.home / "instances"
        sock = Path(path) if isinstance(path, str) else None
        try:
            ours = (sock is not None and sock.name == AGENT_SOCKET and sock.parent.parent == where
                    and bool(check_name(sock.parent.name)))
        except Error:
            ours = False
        if not ours or sock is None:
            raise InvalidInput(f"{str(path)[:200]!r} is not a capsule's agent socket in this store "
                               f"({where}/NAME/{AGENT_SOCKET}): the helper connects to those only")
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_CONNECT_TIMEOUT:
            raise InvalidInput(f"a connect timeout is a number of seconds in (0, {MAX_CONNECT_TIMEOUT}]")
        return {FDS: [ops.connect_agent(self._domain(sock.parent.name), sock, float(timeout))]}

    COMMANDS = {"adopt-memory-image": adopt_memory_image, "pod-bridge-up": pod_bridge_up,
                "sandbox-hand-over": sandbox_hand_over, "run-sandboxed": run_sandboxed, "open-serial": open_serial,
                "connect-agent": connect_agent}

    def handle(self, message: bytes, fds: list[int], truncated: bool = False) -> dict[str, Any]:
        """One request (its bytes and attached descriptors) → its answer; never raises."""
        try:
            if truncated or len(message) > MAX_REQUEST:
                raise InvalidInput(f"a request larger than {MAX_REQUEST} bytes is refused")
            try:
                req = json.loads(message)
            except (ValueError, UnicodeDecodeError):
                raise InvalidInput("a request is one JSON object") from None
            if not isinstance(req, dict):
                raise InvalidInput("a request is one JSON object")
            command = self.COMMANDS.get(req.get("op"))  # type: ignore[arg-type]
            if command is None:
                raise InvalidInput(f"unknown command {str(req.get('op'))[:40]!r}: the helper runs "
                                   f"{', '.join(sorted(self.COMMANDS))} only")
            return {"ok": True, **command(self, req, fds)}
        except Error as exc:
            return {"ok": False, "code": exc.code, "error": str(exc)}
        except Exception as exc:   # an OSError, a timeout: the helper stays up, the agent gets the reason
            return {"ok": False, "code": RuntimeFailure.code, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)


def _answer(helper: Helper, reply: socket.socket, message: bytes, fds: list[int], truncated: bool,
            slots: threading.BoundedSemaphore) -> None:
    out: list[int] = []
    try:
        answer = helper.handle(message, fds, truncated)
        out = answer.pop(FDS, [])
        data = json.dumps(answer).encode()
        if len(data) > MAX_REPLY:
            data = json.dumps({"ok": False, "code": RuntimeFailure.code, "error": "the answer is too large"}).encode()
        with contextlib.suppress(OSError):
            socket.send_fds(reply, [data], out)
    finally:
        for fd in out:
            os.close(fd)
        reply.close()
        slots.release()


def serve(sock: socket.socket, helper: Helper) -> None:
    """Answer requests on ``sock`` until the other end closes it. Each request brings, as its first descriptor,
    the socket its answer goes to, and runs in a thread of its own (at most :data:`MAX_CONCURRENT` at once): a
    long ``debugfs`` does not hold up a memory image's adoption."""
    slots = threading.BoundedSemaphore(MAX_CONCURRENT)
    while True:
        try:
            message, fds, flags, _ = socket.recv_fds(sock, MAX_REQUEST + 1, MAX_FDS + 1)
        except ConnectionError:
            return
        if not message and not fds:
            return
        try:
            reply = socket.socket(fileno=fds[0]) if fds else None
        except OSError:
            reply = None
        if reply is None or reply.type != socket.SOCK_SEQPACKET:   # nowhere to answer: dropped
            for fd in fds[0 if reply is None else 1:]:
                os.close(fd)
            if reply is not None:
                reply.close()
            continue
        truncated = bool(flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC))
        slots.acquire()
        threading.Thread(target=_answer, args=(helper, reply, message, list(fds[1:]), truncated, slots),
                         daemon=True).start()


def _real(path: Path) -> str:
    """``path`` with its directories resolved (the helper compares it with the store's real path); its last
    component is left as it is: the helper refuses it if it is a symbolic link."""
    path = Path(path).absolute()
    return str(Path(os.path.realpath(path.parent)) / path.name)


class HelperClient:
    """The agent's side: :class:`capsule.privsep.Privileged` by asking the root helper (from any thread)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def call(self, op: str, fds: list[int] | None = None, **args: Any) -> dict[str, Any]:
        data = json.dumps({"op": op, **args}).encode()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)   # this request's answer
        with mine:
            try:
                with theirs, self._lock:
                    socket.send_fds(self.sock, [data], [theirs.fileno(), *(fds or [])])
                reply, got, _, _ = socket.recv_fds(mine, MAX_REPLY, 1)
            except OSError as exc:
                raise EnvironmentProblem(f"the root helper is gone ({exc}): restart the agent") from None
        if not reply:
            for fd in got:
                os.close(fd)
            raise EnvironmentProblem("the root helper is gone: restart the agent")
        answer = json.loads(reply)
        if not answer.get("ok"):
            for fd in got:
                os.close(fd)
            raise _ERRORS.get(answer.get("code"), RuntimeFailure)(f"root helper, {op}: {answer.get('error')}")
        answer[FDS] = list(got)
        return answer

    def adopt_memory_image(self, path: Path) -> None:
        self.call("adopt-memory-image", path=_real(path))

    def pod_bridge_up(self) -> str:
        return str(self.call("pod-bridge-up")["bridge"])

    def sandbox_hand_over(self, path: Path) -> None:
        self.call("sandbox-hand-over", path=_real(path))

    def run_sandboxed(self, argv: list[str], cwd: Path, stdout_fd: int, *, timeout: float) -> tuple[int, bytes]:
        r = self.call("run-sandboxed", [stdout_fd], argv=argv, cwd=_real(cwd), timeout=timeout)
        return int(r["status"]), str(r["stderr"]).encode("utf-8", "surrogateescape")

    def _one_fd(self, op: str, **args: Any) -> int:
        got = self.call(op, **args)[FDS]
        if len(got) != 1:
            for fd in got:
                os.close(fd)
            raise RuntimeFailure(f"root helper, {op}: the answer brought no descriptor")
        return int(got[0])

    def open_serial(self, domain: str, pty: Path) -> int:
        return self._one_fd("open-serial", domain=domain)

    def connect_agent(self, path: Path, timeout: float) -> socket.socket:
        return socket.socket(fileno=self._one_fd("connect-agent", path=str(path), timeout=timeout))


def main(argv: list[str]) -> None:
    """``python -m capsule.privsep.helper FD HOME UID GID``: the helper, started as root by the agent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a ^C is the agent's to handle; the helper ends with it
    fd, home, uid, gid = int(argv[0]), Path(argv[1]), int(argv[2]), int(argv[3])
    sock = socket.socket(fileno=fd)
    serve(sock, Helper(home, ops.Owner(uid, gid)))


if __name__ == "__main__":
    main(sys.argv[1:])
