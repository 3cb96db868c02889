"""libvirt's save-image header (the ``sparse`` format included).

libvirt refuses to restore a memory image under a domain name or uuid other
than the one it was saved with. A capsule derived from another, or a capsule
pushed to a host whose store has another id, therefore restores from a
*fork* of the memory image: a copy (reflinked where the file system can,
sparse otherwise) whose embedded domain XML carries the new name and uuid.

Header layout (native little-endian on x86_64)::

    char     magic[16]      "LibvirtQemudSave" ("LibvirtQemudPart" while being written)
    uint32   version, data_len, was_running, format, cookie_offset, unused[14]
    char     data[data_len] domain XML, NUL, cookie XML, NUL, zero padding
    ...      QEMU migration stream (mapped-ram for the sparse format)
"""

from __future__ import annotations

import os
import struct
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from capsule.errors import IntegrityError, RuntimeFailure

MAGIC = b"LibvirtQemudSave"
PARTIAL_MAGIC = b"LibvirtQemudPart"
_HEADER = struct.Struct("<16s19I")
MAX_DATA = 64 * 1024 * 1024


@dataclass
class SaveHeader:
    version: int
    data_len: int
    was_running: int
    format: int
    cookie_offset: int
    domain_xml: str
    cookie: bytes


def read_header(path: Path) -> SaveHeader:
    with open(path, "rb") as f:
        raw = f.read(_HEADER.size)
        if len(raw) < _HEADER.size:
            raise IntegrityError(f"memory image {path.name} is truncated (no libvirt save header)")
        magic, version, data_len, was_running, fmt, cookie_offset, *_ = _HEADER.unpack(raw)
        if magic == PARTIAL_MAGIC:
            raise IntegrityError(f"memory image {path.name} is incomplete: libvirt never finished writing it")
        if magic != MAGIC:
            raise IntegrityError(f"{path.name} is not a libvirt memory image (bad magic)")
        if not 0 < data_len <= MAX_DATA or cookie_offset > data_len:
            raise IntegrityError(f"memory image {path.name} has a corrupt header")
        data = f.read(data_len)
    if len(data) != data_len:
        raise IntegrityError(f"memory image {path.name} is truncated inside its header")
    xml_end = data.find(b"\0")
    if xml_end <= 0:
        raise IntegrityError(f"memory image {path.name} has no domain XML")
    cookie = b""
    if cookie_offset:
        end = data.find(b"\0", cookie_offset)
        cookie = data[cookie_offset:end if end >= 0 else data_len]
    return SaveHeader(version, data_len, was_running, fmt, cookie_offset,
                      data[:xml_end].decode("utf-8", "replace"), cookie)


def parse_xml(xml: str, what: str) -> ET.Element:
    """The domain XML of a memory image (which may come from a peer); garbage is an IntegrityError."""
    try:
        return ET.fromstring(xml)
    except ET.ParseError as exc:
        raise IntegrityError(f"memory image {what}: its domain XML does not parse ({exc})") from None


def identity(xml: str, what: str = "") -> tuple[str, str]:
    root = parse_xml(xml, what)
    return (root.findtext("name") or "", root.findtext("uuid") or "")


def fork(src: Path, dst: Path, *, name: str, uuid: str) -> None:
    """Copy ``src`` to ``dst`` (reflink or sparse) with the embedded domain XML
    renamed to ``name``/``uuid``. ``src`` is never modified."""

    def rename(root: ET.Element) -> None:
        for tag, value in (("name", name), ("uuid", uuid)):
            el = root.find(tag)
            if el is None:
                raise IntegrityError(f"memory image {src.name}: domain XML has no <{tag}>")
            el.text = value

    rewrite(src, dst, rename)


def rewrite(src: Path, dst: Path, edit: Callable[[ET.Element], None]) -> None:
    """Copy ``src`` to ``dst`` (reflink or sparse) with ``edit`` applied to the
    embedded domain XML. ``src`` is never modified."""
    header = read_header(src)
    root = parse_xml(header.domain_xml, src.name)
    edit(root)
    new_xml = ET.tostring(root, encoding="unicode").encode()
    data = new_xml + b"\0"
    cookie_offset = len(data) if header.cookie_offset else 0
    if header.cookie_offset:
        data += header.cookie + b"\0"
    if len(data) > header.data_len:
        raise RuntimeFailure(f"memory image {src.name}: the edited domain XML does not fit its header")
    data += b"\0" * (header.data_len - len(data))
    proc = subprocess.run(["cp", "--reflink=auto", "--sparse=always", str(src), str(dst)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeFailure(f"copying memory image {src.name}: {proc.stderr.strip()}")
    os.chmod(dst, 0o600)
    with open(dst, "r+b") as f:
        raw = bytearray(f.read(_HEADER.size))
        fields = list(_HEADER.unpack(raw))
        fields[5] = cookie_offset
        f.seek(0)
        f.write(_HEADER.pack(*fields))
        f.write(data)
