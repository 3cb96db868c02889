"""A pod image's ``pod.json`` read on the host (for the address it holds), without unpacking the image and
within bounds: the image came from a guest (or a peer that had it from one). Format 2 is a plain tar (pod.json
its last member; the headers are read, the data skipped), format 1 a ``.tar.zst`` (read as one stream). A
pod.json over POD_JSON_MAX bytes, a tar header extended past that, more than POD_JSON_MEMBERS members or more
than POD_JSON_SECONDS of reading is refused as :class:`~capsule.errors.IntegrityError`; memory stays within
about POD_JSON_MAX whatever the archive holds."""

from __future__ import annotations

import io
import ipaddress
import tarfile
import time
from pathlib import Path
from typing import IO, Any, Literal

import zstandard

from capsule.errors import IntegrityError
from hashcache import wirejson

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"   # format 1 (``tar | zstd``)
POD_JSON_MAX = 1 << 20           # a pod.json (and any tar header's extension) larger than this is refused
POD_JSON_MEMBERS = 1 << 16       # CRIU's images of a pod are a few hundred files (and as many paddings)
POD_JSON_SECONDS = 30.0          # reading an image's pod.json stops after this


class _Refused(Exception):
    """Reading an image's pod.json went past a bound (its size, the time, the archive's shape)."""


class _Bounded(io.RawIOBase):
    """A file read for its pod.json: every read checks the deadline, so a member of terabytes of zeros behind a
    few compressed bytes stops reading at ``POD_JSON_SECONDS``."""

    def __init__(self, raw: IO[bytes], deadline: float) -> None:
        super().__init__()
        self.raw, self.deadline = raw, deadline

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.raw.seekable()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def read(self, size: int = -1) -> bytes:
        if time.monotonic() > self.deadline:
            raise _Refused(f"its archive was not read through in {POD_JSON_SECONDS:.0f} s")
        return self.raw.read(POD_JSON_MAX if size is None or size < 0 else size)

    def readinto(self, buf: Any) -> int:
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)


class _Member(tarfile.TarInfo):
    """A tar header whose extended name or attributes (pax, GNU long name) are read only up to POD_JSON_MAX
    (tarfile would read all of them into memory first)."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:   # tarfile's hook, for every header
        if self.type in _EXTENDED and self.size > POD_JSON_MAX:
            raise _Refused(f"a {self.size}-byte extended tar header")
        return super()._proc_member(tar)  # type: ignore[misc]


_EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
             tarfile.GNUTYPE_LONGLINK)


def _pod_json(archive: Path) -> tuple[str, str]:
    """The text of an image's pod.json and why it may be missing: format 2 is a plain tar (pod.json its last
    member; the headers are read, the data skipped), format 1 a ``.tar.zst`` (read as a stream). Bounded: pod.json
    at most POD_JSON_MAX bytes, at most POD_JSON_MEMBERS members, POD_JSON_SECONDS of reading."""
    deadline = time.monotonic() + POD_JSON_SECONDS
    try:
        with archive.open("rb") as f:
            zstd = f.read(4) == ZSTD_MAGIC
            f.seek(0)
            mode: Literal["r|", "r:"]
            if zstd:
                reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
                src, mode = _Bounded(reader, deadline), "r|"
            else:
                src, mode = _Bounded(f, deadline), "r:"
            with tarfile.open(fileobj=src, mode=mode, tarinfo=_Member) as tar:
                for n, m in enumerate(tar):
                    if n >= POD_JSON_MEMBERS:
                        raise _Refused(f"more than {POD_JSON_MEMBERS} members")
                    tar.members.clear()  # type: ignore[attr-defined]  # (tarfile keeps every header it read)
                    if m.name.removeprefix("./") != "pod.json" or not m.isfile():
                        continue
                    if m.size > POD_JSON_MAX:
                        raise _Refused(f"its pod.json is {m.size} bytes, more than {POD_JSON_MAX}")
                    data = tar.extractfile(m)
                    return (data.read(POD_JSON_MAX).decode(errors="replace") if data else ""), ""
    except _Refused as e:
        return "", f"refused: {e}"
    except (tarfile.TarError, zstandard.ZstdError, OSError, EOFError) as e:
        return "", str(e)
    return "", "no such member"


def image_address(archive: Path) -> str:
    """The address a pod image holds (its pod.json), read without unpacking the rest."""
    text, why = _pod_json(archive)
    try:
        ip = wirejson.loads(text)["ip"]
        if not isinstance(ip, str):
            raise TypeError("not text")
        ipaddress.IPv4Interface(ip)
    except (ValueError, KeyError, TypeError):
        raise IntegrityError(f"pod image {archive.name} holds no pod.json with an address ({why or 'malformed'})"
                             ) from None
    return str(ip)
