"""The guest's serial console: waiting for the boot marker in the console
log, and a scriptable session over libvirt's console stream."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import select
import time
import tty
import xml.etree.ElementTree as ET
from pathlib import Path

from capsule.errors import GuestTimeout, RuntimeFailure
from capsule.runtime import guestfiles
from capsule.runtime.connection import lookup_domain

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]")


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
    Debian's autologin getty), through the console's host pty. For tests and
    scripted demos."""

    def __init__(self, domain: str, ready_timeout: float = 90.0) -> None:
        dom = lookup_domain(domain)
        if dom is None:
            raise RuntimeFailure(f"domain {domain} is not running")
        root = ET.fromstring(dom.XMLDesc(0))
        src = root.find("./devices/serial/source")
        path = src.get("path") if src is not None else None
        if not path:
            raise RuntimeFailure(f"domain {domain} has no serial console pty")
        self.fd = guestfiles.open_pty(Path(path), f"domain {domain}'s serial console")
        tty.setraw(self.fd)
        self.buffer = b""
        self._wait_for_shell(ready_timeout)

    def _wait_for_shell(self, timeout: float) -> None:
        """Make the shell quiet (no echo, no prompt) and wait until it answers:
        a getty may still be starting and swallow what we type."""
        tag = secrets.token_hex(4)
        ready = f"__CAPS_READY_{tag}__".encode()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # ^C first: a line half-read when the guest was saved (the rest of it lost with the old pty) may
            # have left the shell inside an open quote, where every later line would be swallowed
            self.send(f"\x03\nstty -echo; PS1=''; echo __CAPS_RE''ADY_{tag}__\n")
            until = time.monotonic() + 2.0
            while time.monotonic() < until:
                if ready in self.buffer:
                    self.drain(0.2)
                    return
                self._recv(0.1)
        raise GuestTimeout(f"no shell answered on the serial console within {timeout:.0f}s")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send("stty echo; PS1='# '\n")
            os.close(self.fd)

    def __enter__(self) -> ConsoleSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv(self, wait: float = 0.05) -> bool:
        ready, _, _ = select.select([self.fd], [], [], wait)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise RuntimeFailure(f"console closed: {exc}") from exc
        self.buffer += data
        return bool(data)

    def send(self, text: str, timeout: float = 30.0) -> None:
        payload = text.encode()
        deadline = time.monotonic() + timeout
        while payload:
            try:
                n = os.write(self.fd, payload)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise GuestTimeout(f"the guest's console took no input for {timeout:.0f}s "
                                       f"({len(payload)} bytes still to send)") from None
                time.sleep(0.01)
                continue
            payload = payload[n:]

    def drain(self, quiet: float = 0.3) -> None:
        """Read whatever the guest printed until it is quiet for ``quiet`` seconds."""
        while self._recv(quiet):
            pass
        self.buffer = b""

    def run(self, command: str, timeout: float = 30.0) -> str:
        """Run ``command`` in the guest shell and return its output."""
        tag = secrets.token_hex(4)
        self.drain(0.05)
        # The echoed command line holds B''EGIN and E''ND; only the output holds the joined markers. One
        # compound command: the shell runs nothing before it has read (and so echoed) every line, so no echo
        # of a later line can land between the markers, as it could when the lines ran one by one.
        self.send(f"{{ echo __CAPS_B''EGIN_{tag}__\n{command}\necho __CAPS_E''ND_{tag}_$?__; }}\n")
        begin = f"__CAPS_BEGIN_{tag}__".encode()
        pattern = re.compile(rb"__CAPS_END_" + tag.encode() + rb"_(\d+)__")
        deadline = time.monotonic() + timeout
        while True:
            m = pattern.search(self.buffer)
            b = self.buffer.find(begin)
            if m and 0 <= b < m.start():
                out = self.buffer[b + len(begin): m.start()].decode("utf-8", "replace")
                out = _ANSI.sub("", out.replace("\r", ""))
                lines = [ln for ln in out.split("\n") if f"E''ND_{tag}" not in ln]
                status = int(m.group(1))
                if status != 0:
                    raise RuntimeFailure(f"guest command failed ({status}): {command}\n" + "\n".join(lines))
                return "\n".join(lines).strip()
            if time.monotonic() > deadline:
                raise GuestTimeout(f"guest command did not finish in {timeout:.0f}s: {command}")
            self._recv()
