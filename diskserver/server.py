"""Run the disk server: nbdkit with the diskserver Python plugin, exporting one chain on a unix socket.

QEMU (run by libvirt) reads the export as the read-only backing file of an instance's local leaf
layer: ``qemu-img create -f qcow2 -F raw -b BACKING LEAF`` with BACKING =
``json:{"driver":"raw","file":{"driver":"nbd","server":{"type":"unix","path":SOCK}}}``
(:meth:`DiskServer.qemu_backing`), or ``nbd+unix:///?socket=SOCK``; or by ``blockdev-add`` with
:meth:`DiskServer.qemu_blockdev`.

The process runs in its own session, so that signals aimed at the process group of whoever started it
(a terminal's Ctrl-C, a CLI exiting) do not reach it. With ``exit_with_parent=True`` nbdkit exits when
the process that started it exits (for tests and one-shot use); without it the server outlives that
process, and a later process manages it through its pid file (:meth:`DiskServer.attach`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from diskserver.errors import ServerError
from diskserver.nbdclient import probe

PLUGIN = Path(__file__).resolve().parent / "plugin.py"
# the native read path (diskserver/fastread/fastread.c), built by `make native`; without it the plugin
# serves every read itself
FASTREAD = Path(__file__).resolve().parent / "fastread" / "capsule-fastread.so"
_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the NUL


def _site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class DiskServer:
    """One nbdkit process serving the chain of ``spec_path`` on ``socket_path``, logging to ``log_path``."""

    def __init__(
        self,
        spec_path: str | os.PathLike[str],
        socket_path: str | os.PathLike[str],
        log_path: str | os.PathLike[str],
        *,
        exit_with_parent: bool = False,
        pid_path: str | os.PathLike[str] | None = None,
        socket_mode: int = 0o660,
        socket_group: int | None = None,
        site_packages: str | None = None,
        threads: int | None = None,
        prefetch: bool | None = None,
        verbose: bool = False,
        nbdkit: str = "nbdkit",
        native: bool = True,
    ) -> None:
        self.spec_path = Path(spec_path).resolve()
        self.socket_path = Path(socket_path).absolute()
        self.log_path = Path(log_path).absolute()
        self.pid_path = Path(pid_path).absolute() if pid_path else Path(f"{self.socket_path}.pid")
        self.exit_with_parent = exit_with_parent
        self.socket_mode = socket_mode
        self.socket_group = socket_group  # the socket's group (its client's, e.g. QEMU's); None: nbdkit's
        self.site_packages = site_packages or _site_packages()
        self.threads = threads
        self.prefetch = prefetch
        self.verbose = verbose
        self.nbdkit = nbdkit
        self.native = native  # the native read path in front of the plugin, where `make native` built it
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        if len(os.fsencode(self.socket_path)) > _MAX_SOCKET_PATH:
            raise ServerError(f"socket path {self.socket_path} is longer than {_MAX_SOCKET_PATH} bytes, the limit of "
                              "a unix socket address; use a shorter directory")

    # -- addresses -----------------------------------------------------------------------------------

    @property
    def uri(self) -> str:
        """NBD URI for qemu-img / qemu-io: ``nbd+unix:///?socket=SOCK``."""
        return f"nbd+unix:///?socket={self.socket_path}"

    def qemu_blockdev(self) -> dict[str, Any]:
        """blockdev-add options for QEMU (read-only raw over NBD)."""
        return {"driver": "nbd", "server": {"type": "unix", "path": str(self.socket_path)}, "read-only": True}

    def qemu_backing(self) -> str:
        """A backing-file name for a qcow2 leaf; give it backing format ``raw`` (``qemu-img create -F raw``)."""
        nbd = {"driver": "nbd", "server": {"type": "unix", "path": str(self.socket_path)}}
        return "json:" + json.dumps({"driver": "raw", "file": nbd}, separators=(",", ":"))

    # -- lifecycle -----------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """nbdkit's pid: the process we started, or (when it runs under a waiting shell, or was started
        by another process) the one its pid file names."""
        if self._proc is not None and self.exit_with_parent:
            return self._proc.pid
        if self._pid is None:
            with contextlib.suppress(OSError, ValueError):
                self._pid = int(self.pid_path.read_text().strip())
        return self._pid

    def command(self) -> list[str]:
        cmd = [self.nbdkit, "--foreground", "--readonly", "--unix", str(self.socket_path), "--pidfile",
               str(self.pid_path)]
        if self.exit_with_parent:
            cmd.append("--exit-with-parent")
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        if self.verbose:
            cmd.append("--verbose")
        if self.native and FASTREAD.is_file():
            cmd.append(f"--filter={FASTREAD}")
        cmd += ["python", str(PLUGIN), f"spec={self.spec_path}"]
        if self.prefetch is not None:
            cmd.append(f"prefetch={'true' if self.prefetch else 'false'}")
        return cmd

    def _argv(self) -> list[str]:
        """What to run. nbdkit in the foreground dies with its parent (Debian's 1.32 sets its parent-death
        signal even without --exit-with-parent), so unless it should, it runs under a shell in its own
        session that waits for it: the server outlives the process that started it (a `capsule start --from`)."""
        if self.exit_with_parent:
            return self.command()
        return ["/bin/sh", "-c", '"$@"; exit $?', "capsule-diskserver", *self.command()]

    def start(self, timeout: float = 30.0) -> DiskServer:
        """Start nbdkit and wait until the socket answers the NBD handshake; raise ServerError otherwise."""
        if self.alive():
            raise ServerError(f"a disk server (pid {self.pid}) is already running on {self.socket_path}")
        if self.socket_path.exists():
            if probe(str(self.socket_path), timeout=1.0):
                raise ServerError(f"another NBD server already listens on {self.socket_path}")
            self.socket_path.unlink()
        self.pid_path.unlink(missing_ok=True)
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CAPSULE_SITE_PACKAGES=self.site_packages, PYTHONDONTWRITEBYTECODE="1")
        with open(self.log_path, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.command())}\n".encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                              env=env, start_new_session=True, close_fds=True)
            except OSError as exc:
                raise ServerError(f"cannot run {self.nbdkit}: {exc.strerror or exc}") from exc
        self._pid = None  # read from the pid file once nbdkit has written it
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        sock = str(self.socket_path)
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise ServerError(f"the disk server for {self.spec_path} exited with status {rc} while starting; "
                                  f"log {self.log_path}:\n{_log_tail(self.log_path)}")
            if os.path.exists(sock) and probe(sock, timeout=max(0.5, deadline - time.monotonic())):
                if self.socket_group is not None:
                    os.chown(sock, -1, self.socket_group)
                with contextlib.suppress(OSError):
                    os.chmod(sock, self.socket_mode)
                return
            if time.monotonic() > deadline:
                raise ServerError(f"the disk server for {self.spec_path} did not answer on {sock} within "
                                  f"{timeout:g} s; log {self.log_path}:\n{_log_tail(self.log_path)}")
            time.sleep(0.02)

    def alive(self) -> bool:
        """True while the nbdkit process runs (ours, or the one named by the pid file)."""
        if self._proc is not None:
            return self._proc.poll() is None
        pid = self.pid
        if pid is None:
            return False
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return bool(cmdline) and os.path.basename(cmdline[0]) == b"nbdkit" and os.fsencode(self.socket_path) in cmdline

    def _signal(self, sig: int) -> None:
        pid = self.pid
        if pid is not None and self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.alive():
            if self._proc is not None:
                try:
                    self._proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    return False
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the plugin persists fetched blocks and writes its stats), then SIGKILL after ``timeout``."""
        if self.alive():
            self._signal(signal.SIGTERM)
            if not self._wait_exit(timeout):
                self._signal(signal.SIGKILL)
                self._wait_exit(5.0)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(1)
        self._cleanup_files()

    def kill(self) -> None:
        """SIGKILL, no clean-up by the plugin (tests: a crash)."""
        self._signal(signal.SIGKILL)
        self._wait_exit(5.0)
        self._cleanup_files()

    def _cleanup_files(self) -> None:
        if not self.alive():
            self.socket_path.unlink(missing_ok=True)
            self.pid_path.unlink(missing_ok=True)

    @classmethod
    def attach(
        cls,
        spec_path: str | os.PathLike[str],
        socket_path: str | os.PathLike[str],
        log_path: str | os.PathLike[str],
        pid_path: str | os.PathLike[str] | None = None,
        socket_group: int | None = None,
    ) -> DiskServer:
        """A handle on a server started earlier (perhaps by another process), found by its pid file."""
        return cls(spec_path, socket_path, log_path, pid_path=pid_path, socket_group=socket_group)

    def __enter__(self) -> DiskServer:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observing -----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any] | None:
        """The chain's stats file (written every ``stats_interval`` seconds and at exit), or None."""
        from diskserver.chain import ChainSpec

        path = ChainSpec.load(self.spec_path).resolved_stats_path
        try:
            stats: dict[str, Any] | None = json.loads(path.read_text())  # the chain writes an object
        except (OSError, ValueError):
            return None
        return stats

    def log_tail(self, lines: int = 20) -> str:
        return _log_tail(self.log_path, lines)


def main_serve(spec_path: str, socket_path: str, log_path: str | None = None) -> int:  # pragma: no cover - CLI
    """Run a server in the foreground until interrupted (``python -m diskserver serve``)."""
    log = log_path or f"{socket_path}.log"
    server = DiskServer(spec_path, socket_path, log, exit_with_parent=True).start()
    print(f"serving {spec_path} on {server.uri} (log {log})", file=sys.stderr)
    try:
        while server.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
