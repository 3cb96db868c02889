"""A running guest's QEMU migration stream, read live by this process (tests and benchmarks of the memory
codec, :mod:`capsule.migrate.ramdedup`).

:func:`stream_out` makes QEMU migrate the guest (precopy, no xbzrle, no multifd) to a unix socket this process
reads: ``sink(chunk)`` gets every byte as QEMU writes it. QEMU ends paused ("postmigrate").
:func:`restore_stream` restores a domain from a stream: the domain's own libvirt save image, libvirt's save
image of it made of its XML and the given stream."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import libvirt
import libvirt_qemu

from capsule.runtime.connection import connect

SAVE_HEADER = struct.Struct("<16s19I")


def qmp(dom: libvirt.virDomain, command: str, **args: object) -> dict:
    msg: dict[str, object] = {"execute": command}
    if args:
        msg["arguments"] = args
    return json.loads(libvirt_qemu.qemuMonitorCommand(dom, json.dumps(msg), 0))


def stream_out(dom: libvirt.virDomain, sock_dir: Path, sink: Callable[[bytes], None], *,
               timeout: float = 300.0, chunk: int = 1 << 16) -> dict:
    """Migrate ``dom`` to a unix socket this process listens on in ``sock_dir`` (a directory QEMU may reach),
    every byte to ``sink``; answers ``query-migrate``'s last answer."""
    path = sock_dir / "migration.sock"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o666)
    listener.listen(1)
    listener.settimeout(timeout)
    caps = [{"capability": c, "state": False} for c in ("xbzrle", "multifd", "postcopy-ram", "mapped-ram")]
    for command, args in (("migrate-set-capabilities", {"capabilities": caps}),
                          ("migrate-set-parameters", {"max-bandwidth": 1 << 40})):
        if "error" in (answer := qmp(dom, command, **args)):
            raise RuntimeError(f"{command}: {answer['error']}")
    failure: list[BaseException] = []

    def read() -> None:
        try:
            conn, _ = listener.accept()
            with conn:
                while data := conn.recv(chunk):
                    sink(data)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
            failure.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if "error" in (answer := qmp(dom, "migrate", uri=f"unix:{path}")):
            raise RuntimeError(f"migrate: {answer['error']}")
        deadline = time.monotonic() + timeout
        while True:
            state = qmp(dom, "query-migrate")["return"]
            if state.get("status") in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        reader.join(timeout if state.get("status") == "completed" else 1.0)
    finally:
        listener.close()
        path.unlink()
    if failure:
        raise failure[0]
    if state.get("status") != "completed":
        raise RuntimeError(f"the migration did not complete: {state}")
    return state


def save_xml(dom: libvirt.virDomain) -> str:
    """The domain XML libvirt would put in a save image of ``dom`` (take it before :func:`stream_out`)."""
    return dom.XMLDesc(libvirt.VIR_DOMAIN_XML_SECURE | libvirt.VIR_DOMAIN_XML_MIGRATABLE)


def restore_stream(dom: libvirt.virDomain, xml: str, stream: Path, work: Path) -> libvirt.virDomain:
    """Destroy ``dom`` and restore it from ``stream`` (a QEMU migration stream of it) as libvirt restores a save
    image: a save header with ``xml`` (:func:`save_xml`), then the stream. Answers the running domain."""
    data = xml.encode() + b"\0"
    data += bytes(-len(data) % 4096)
    image = work / "restore.save"
    with open(image, "wb") as out, open(stream, "rb") as src:
        out.write(SAVE_HEADER.pack(b"LibvirtQemudSave", 2, len(data), 1, 0, 0, *[0] * 14))
        out.write(data)
        while block := src.read(1 << 20):
            out.write(block)
    os.chmod(image, 0o644)
    with contextlib.suppress(libvirt.libvirtError):
        dom.destroy()
    conn = connect()
    conn.restoreFlags(str(image), None, libvirt.VIR_DOMAIN_SAVE_RUNNING)
    return conn.lookupByName(dom.name())
