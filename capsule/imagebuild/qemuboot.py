"""Boot a built image with plain QEMU (TCG) and talk to its serial console.

Used by the image tests and handy for checking an image by hand:

    with SerialGuest.boot(image, workdir) as g:
        g.wait_for_marker(timeout=30)
        out = g.run("dd if=/dev/vda bs=4096 count=1 | md5sum")
        g.agent_call("ping")  # the guest agent, over the virtio-serial port org.capsule.agent.0
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from hashcache.errors import Error

from .common import AGENT_PORT, BuiltImage

_ANSI = re.compile(rb"\x1b(\[[0-9;?]*[A-Za-z]|[()][A-Za-z0-9]|[A-Za-z])")


class GuestError(Error):
    """The guest did not do what was expected; the message has the tail of its console."""

    code = "image_guest_error"
    exit_code = 7


class SerialGuest:
    """A QEMU process whose ttyS0 is a unix socket we read from and type into."""

    def __init__(
        self,
        kernel: Path,
        initrd: Path,
        disk: Path,
        cmdline: str,
        *,
        memory_mb: int = 256,
        accel: str = "tcg",
        extra_args: Sequence[str] = (),
        snapshot: bool = False,
        log_path: Path | None = None,
        agent_port: bool = True,
    ) -> None:
        self._sockdir = tempfile.mkdtemp(prefix="capsule-serial-")  # short path: sun_path is 108 bytes
        self.sock_path = os.path.join(self._sockdir, "ttyS0")
        # the guest agent's virtio-serial port, as a unix socket QEMU listens on (libvirt's <channel>)
        self.agent_sock_path = os.path.join(self._sockdir, "agent") if agent_port else None
        agent_args = (
            [
                "-chardev", f"socket,id=agent0,path={self.agent_sock_path},server=on,wait=off",
                "-device", f"virtserialport,bus=vser0.0,chardev=agent0,name={AGENT_PORT}",
            ]
            if agent_port
            else []
        )  # fmt: skip
        drive = f"file={disk},format=raw,if=virtio,cache=unsafe"
        if snapshot:
            drive += ",snapshot=on"
        self.argv = [
            shutil.which("qemu-system-x86_64") or "qemu-system-x86_64",
            "-accel", accel,
            "-m", str(memory_mb),
            "-smp", "1",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(kernel), "-initrd", str(initrd), "-append", cmdline,
            "-drive", drive,
            "-device", "virtio-serial,id=vser0",
            "-device", "virtio-balloon",
            "-chardev", f"socket,id=ser0,path={self.sock_path},server=on,wait=on",
            "-serial", "chardev:ser0",
            *agent_args,
            *extra_args,
        ]  # fmt: skip
        self.log_path = log_path
        self._buf = bytearray()
        self._cond = threading.Condition()
        self._eof = False
        self._seq = 0
        self.started = 0.0
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self._reader: threading.Thread | None = None

    @classmethod
    def boot(cls, image: BuiltImage, **kw: object) -> SerialGuest:
        guest = cls(image.kernel, image.initrd, image.disk_raw, image.cmdline, **kw)  # type: ignore[arg-type]
        guest.start()
        return guest

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self, connect_timeout: float = 20.0) -> None:
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + connect_timeout
        while True:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
                raise GuestError(f"qemu exited with {self.proc.returncode} before the serial socket:\n{out}")
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(self.sock_path)
                break
            except OSError:
                s.close()
                if time.monotonic() > deadline:
                    self.close()
                    raise GuestError(f"qemu's serial socket {self.sock_path} never came up") from None
                time.sleep(0.05)
        self.sock = s
        self.started = time.monotonic()
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        assert self.sock is not None
        log = self.log_path.open("ab") if self.log_path else None
        try:
            while True:
                try:
                    data = self.sock.recv(65536)
                except OSError:
                    data = b""
                if log is not None and data:
                    log.write(data)
                    log.flush()
                with self._cond:
                    if not data:
                        self._eof = True
                        self._cond.notify_all()
                        return
                    self._buf += data
                    self._cond.notify_all()
        finally:
            if log is not None:
                log.close()

    def close(self, timeout: float = 10.0) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self._sockdir, ignore_errors=True)

    def __enter__(self) -> SerialGuest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- console -----------------------------------------------------------------------------------
    @property
    def output(self) -> str:
        """Everything the guest printed so far, escape sequences removed."""
        with self._cond:
            raw = bytes(self._buf)
        return _ANSI.sub(b"", raw).decode("utf-8", "replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.output.replace("\r", "").splitlines()[-lines:])

    def wait_for(self, pattern: str | re.Pattern[str], timeout: float, start: int = 0) -> re.Match[str]:
        """Wait until the console output (from character `start`) matches `pattern`."""
        rx = re.compile(re.escape(pattern)) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                text = _ANSI.sub(b"", bytes(self._buf)).decode("utf-8", "replace")
                m = rx.search(text, start)
                if m:
                    return m
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    why = "the console closed (qemu exited?)" if self._eof else f"{timeout:.0f} s passed"
                    raise GuestError(
                        f"waiting for {rx.pattern!r} on the serial console: {why}\n--- console tail ---\n{self.tail()}"
                    )
                self._cond.wait(min(left, 0.5))

    def wait_for_marker(self, marker: str = "CAPSULE-GUEST-READY", timeout: float = 60.0) -> float:
        """Wait for the readiness line; return the seconds since QEMU started."""
        self.wait_for(re.compile(rf"(?m)^\r*{re.escape(marker)}\r*$"), timeout)
        return time.monotonic() - self.started

    def wait_for_shell(self, timeout: float = 30.0) -> float:
        """Wait until a shell answers on the console; return the seconds since QEMU started.

        The marker can come a moment before the shell reads input (and a getty may flush what was
        typed before it started), so probe with `true` until one answers.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                self.run("true", timeout=max(0.5, min(3.0, left)))
                return time.monotonic() - self.started
            except GuestError:
                if left <= 0 or self._eof:
                    raise

    def send(self, text: str) -> None:
        assert self.sock is not None
        self.sock.sendall(text.encode())

    def run(self, command: str, timeout: float = 30.0, check: bool = True) -> str:
        """Type a shell command on the console; return its output (stdout+stderr), minus the echo.

        Works with any POSIX shell on the console. What is typed is
            echo '__CAPS''ULE_BEGIN_n__'; { COMMAND
            }; echo '__CAPS''ULE_END_n__':$?
        The shell reads both lines (echoing them, printing its PS2) before it runs anything, so
        everything between the printed BEGIN and END lines is the command's own output; the typed
        text never matches the printed markers thanks to the quotes.
        """
        self._seq += 1
        n = self._seq
        begin, end = f"__CAPSULE_BEGIN_{n}__", f"__CAPSULE_END_{n}__"
        with self._cond:
            start = len(_ANSI.sub(b"", bytes(self._buf)).decode("utf-8", "replace"))
        split = lambda s: f"'{s[:6]}''{s[6:]}'"  # noqa: E731 - '__CAPS''ULE_...' prints as one word
        self.send(f"echo {split(begin)}; {{ {command}\n}}; echo {split(end)}:$?\n")
        m_end = self.wait_for(re.compile(rf"{end}:(\d+)"), timeout, start)
        m_begin = self.wait_for(re.compile(rf"{begin}\r?\n"), 0.1, start)
        out = self.output[m_begin.end() : m_end.start()].replace("\r", "").rstrip("\n")
        status = int(m_end.group(1))
        if check and status != 0:
            raise GuestError(f"`{command}` exited with {status} in the guest:\n{out}")
        return out

    # --- guest agent -------------------------------------------------------------------------------
    def agent_call(self, cmd: str, args: dict | None = None, timeout: float = 30.0) -> dict:
        """One request to the guest agent over its virtio-serial port; returns the whole reply object.

        Connects to the port's socket, sends a bare newline (PROTOCOL.md: it ends any partial line
        an earlier host left) and the request, and waits for the reply line with the same id. Bytes
        sent while no agent has the port open may be lost (right after boot, or while a killed agent
        is being restarted), so an unanswered request is sent again on a new connection every 5 s.
        """
        if self.agent_sock_path is None:
            raise GuestError("this guest was started without the agent port (agent_port=False)")
        deadline = time.monotonic() + timeout
        while True:
            self._seq += 1
            attempt_end = min(deadline, time.monotonic() + 5.0)
            reply = self._agent_attempt(cmd, args, self._seq, attempt_end)
            if reply is not None:
                return reply
            if time.monotonic() >= deadline:
                raise GuestError(f"the guest agent did not answer {cmd!r} within {timeout:.0f} s")

    def _agent_attempt(self, cmd: str, args: dict | None, rid: int, until: float) -> dict | None:
        req: dict = {"id": rid, "cmd": cmd}
        if args is not None:
            req["args"] = args
        buf = b""
        assert self.agent_sock_path is not None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(max(0.1, until - time.monotonic()))
            s.connect(self.agent_sock_path)
            s.sendall(b"\n" + json.dumps(req).encode() + b"\n")
            while True:
                while b"\n" not in buf:
                    left = until - time.monotonic()
                    if left <= 0:
                        return None
                    s.settimeout(left)
                    try:
                        chunk = s.recv(1 << 16)
                    except TimeoutError:
                        continue
                    if not chunk:
                        raise GuestError(f"the guest agent port closed while waiting for the reply to {cmd!r}")
                    buf += chunk
                line, _, buf = buf.partition(b"\n")
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue  # blank or broken line
                if isinstance(reply, dict) and reply.get("id") == rid:
                    return reply
