"""QMP commands to a running domain's QEMU, for what libvirt has no API for: through libvirt's monitor
(:func:`command`, ``virsh qemu-monitor-command``: a disk's backing name, a post-copy's resume at its source), or
through a monitor of the domain's own (:func:`with_monitor`, :func:`over_socket`: a post-copy's recovery at its
destination, where libvirt admits no monitor command)."""

from __future__ import annotations

import json
import socket
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import libvirt
import libvirt_qemu

from capsule.errors import RuntimeFailure


def command(dom: libvirt.virDomain, cmd: str, **args: object) -> object:
    """Run ``cmd`` with ``args``; its ``return``. QEMU's error (or libvirt's) → :class:`RuntimeFailure`."""
    try:
        reply = json.loads(libvirt_qemu.qemuMonitorCommand(dom, json.dumps({"execute": cmd, "arguments": args}), 0))
    except libvirt.libvirtError as exc:
        raise RuntimeFailure(f"QEMU {cmd}: {exc.get_error_message() or exc}") from exc
    if "error" in reply:
        raise RuntimeFailure(f"QEMU {cmd}: {reply['error'].get('desc', reply['error'])}")
    return reply.get("return")


QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
MONITOR = "recover.sock"       # in an arriving guest's instance directory (capsule.exchange.incoming)
MAX_SOCKET_PATH = 100          # a unix socket's path is at most 107 bytes


def with_monitor(xml: str, path: Path) -> str:
    """``xml`` with a QMP monitor of its own on the unix socket ``path`` (``-qmp``), beside libvirt's: for what
    libvirt refuses while it holds a job on the domain, a post-copy's ``migrate-recover`` at its destination
    (libvirt keeps the incoming migration's job, which admits no monitor command, after the post-copy lost its
    link). Unchanged when the path is too long for a socket."""
    if len(str(path)) > MAX_SOCKET_PATH:
        return xml
    ET.register_namespace("qemu", QEMU_NS)
    root = ET.fromstring(xml)
    line = ET.SubElement(root, f"{{{QEMU_NS}}}commandline")
    for value in ("-qmp", f"unix:{path},server=on,wait=off"):
        ET.SubElement(line, f"{{{QEMU_NS}}}arg", value=value)
    return ET.tostring(root, encoding="unicode")


def over_socket(path: Path, cmd: str, timeout: float = 10.0, **args: object) -> object:
    """Run ``cmd`` on the QMP monitor at ``path`` (:func:`with_monitor`); its ``return``. Out of band when the
    monitor offers it (``exec-oob``): QEMU then runs it outside its main loop, which a post-copy that lost its
    link may hold blocked (a device writing into a page still at the source), the very state ``migrate-recover``
    is for. QEMU's error, or a monitor that does not answer → :class:`RuntimeFailure`."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            lines = sock.makefile("rwb")
            greeting = _reply(lines).get("QMP", {})
            oob = "oob" in (greeting.get("capabilities") or [])
            hello: dict[str, object] = {"execute": "qmp_capabilities"}
            if oob:
                hello["arguments"] = {"enable": ["oob"]}
            run: dict[str, object] = ({"exec-oob": cmd, "id": "capsule"} if oob else {"execute": cmd})
            for message in (hello, run | {"arguments": args}):
                lines.write(json.dumps(message).encode() + b"\n")
                lines.flush()
                reply = _reply(lines)
    except (OSError, ValueError, AttributeError) as exc:
        raise RuntimeFailure(f"QEMU {cmd}: its monitor at {path} does not answer ({exc})") from exc
    if "error" in reply:
        raise RuntimeFailure(f"QEMU {cmd}: {reply['error'].get('desc', reply['error'])}")
    return reply.get("return")


def _reply(lines: Any) -> dict:
    """The next message that is not an event."""
    while True:
        line = lines.readline(1 << 20)
        if not line:
            raise ValueError("the monitor closed the connection")
        message = json.loads(line)
        if isinstance(message, dict) and "event" not in message:
            return message
