"""The guest's serial console: waiting for the boot marker in the console
log, and a scriptable session over libvirt's console stream."""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

import libvirt

from capsule.errors import GuestTimeout, RuntimeFailure
from capsule.runtime.connection import connect, lookup_domain


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def wait_for_marker(log: Path, marker: str, timeout: float, offset: int = 0, domain: str | None = None) -> float:
    """Wait until ``marker`` appears in the console log after ``offset``.
    Returns the seconds waited; raises GuestTimeout (or RuntimeFailure if the
    domain disappears meanwhile)."""
    start = time.monotonic()
    needle = marker.encode()
    while True:
        try:
            with open(log, "rb") as f:
                f.seek(offset)
                if needle in f.read():
                    return time.monotonic() - start
        except FileNotFoundError:
            pass
        if domain is not None and lookup_domain(domain) is None:
            raise RuntimeFailure(f"domain {domain} stopped before the guest printed {marker!r}; see {log}")
        if time.monotonic() - start > timeout:
            raise GuestTimeout(f"the guest did not print {marker!r} within {timeout:.0f}s; see {log}")
        time.sleep(0.1)


class ConsoleSession:
    """Run shell commands on a guest's serial console (tiny guest's root shell,
    Debian's autologin getty). For tests and scripted demos."""

    def __init__(self, domain: str) -> None:
        dom = lookup_domain(domain)
        if dom is None:
            raise RuntimeFailure(f"domain {domain} is not running")
        self.stream = connect().newStream(libvirt.VIR_STREAM_NONBLOCK)
        dom.openConsole(None, self.stream, libvirt.VIR_DOMAIN_CONSOLE_FORCE)
        self.buffer = b""

    def close(self) -> None:
        try:
            self.stream.finish()
        except libvirt.libvirtError:
            pass

    def __enter__(self) -> ConsoleSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv(self) -> bool:
        try:
            data = self.stream.recv(65536)
        except libvirt.libvirtError as exc:
            raise RuntimeFailure(f"console stream failed: {exc}") from exc
        if data == -2 or not data:
            return False
        self.buffer += data if isinstance(data, bytes) else bytes(data)
        return True

    def send(self, text: str) -> None:
        payload = text.encode()
        while payload:
            n = self.stream.send(payload)
            if n == -2:
                time.sleep(0.01)
                continue
            payload = payload[n:]

    def run(self, command: str, timeout: float = 30.0) -> str:
        """Run ``command`` in the guest shell and return its output."""
        tag = secrets.token_hex(4)
        self.buffer = b""
        # The echoed command line contains 'E''ND', the output 'END': only the output matches.
        self.send(f"{command}; echo __CAPS_E''ND_{tag}_$?__\n")
        pattern = re.compile(rb"__CAPS_END_" + tag.encode() + rb"_(\d+)__")
        deadline = time.monotonic() + timeout
        while True:
            m = pattern.search(self.buffer)
            if m:
                out = self.buffer[: m.start()].decode("utf-8", "replace")
                # drop the echoed command line
                lines = out.replace("\r", "").split("\n")
                body = [ln for ln in lines if f"E''ND_{tag}" not in ln]
                status = int(m.group(1))
                if status != 0:
                    raise RuntimeFailure(f"guest command failed ({status}): {command}\n" + "\n".join(body))
                return "\n".join(body).strip()
            if time.monotonic() > deadline:
                raise GuestTimeout(f"guest command did not finish in {timeout:.0f}s: {command}")
            if not self._recv():
                time.sleep(0.02)
