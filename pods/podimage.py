"""A pod image's archive. Format 2 (this one): an uncompressed POSIX tar in which every file's data starts
at a 4096-byte offset — a zero-filled padding member (``PAD``) goes before any file whose data would not —
and ``pod.json`` comes last, listing every file and its size. The host stores the image as a sealed file
object and HCP moves it in 4 KiB blocks, zstd on the wire: CRIU's page images, aligned, dedup block for
block against an earlier image of the same pod (a move back, a second move), and blocks of zeros never
travel. Format 1 was ``tar | zstd -3`` (``.tar.zst``): still read (by its zstd magic), so an image made
before the upgrade restores after it, but nothing dedups against it.

Unpacking takes regular files and directories only, under relative names without ``..``: anything else (an
absolute name, ``..``, a link, a device), a truncated or malformed archive, or a file list that does not
match what was unpacked is refused with :class:`ImageInvalid`."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path, PurePosixPath
from typing import IO, Any

ALIGN = 4096
PAD = ".pad"
META = "pod.json"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_FMT = tarfile.PAX_FORMAT


class ImageInvalid(Exception):
    """The archive is not a pod image this code can unpack safely."""


def _info(name: str, size: int, mtime: float = 0.0) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = size, 0o600, int(mtime)
    return ti


def _header_len(tar: tarfile.TarFile, ti: tarfile.TarInfo) -> int:
    return len(ti.tobuf(tar.format, tar.encoding, tar.errors))


def _add_aligned(tar: tarfile.TarFile, ti: tarfile.TarInfo, data: IO[bytes]) -> None:
    """Add one file so its data starts at a multiple of ALIGN: first a padding member of the right size."""
    gap = (-(tar.offset + _header_len(tar, ti))) % ALIGN
    if gap:  # a multiple of 512: one header block and gap - 512 bytes of zeros
        tar.addfile(_info(PAD, gap - 512), io.BytesIO(bytes(gap - 512)))
    assert (tar.offset + _header_len(tar, ti)) % ALIGN == 0
    tar.addfile(ti, data)


def pack(images: Path, out: Path, meta: dict[str, Any]) -> None:
    """Write ``images``' files (flat: CRIU's image directory) and ``meta`` as ``pod.json`` into ``out``."""
    files = sorted(p for p in images.iterdir() if p.is_file() and p.name != META)
    meta = {**meta, "files": {p.name: p.stat().st_size for p in files}}
    with out.open("wb") as f, tarfile.open(fileobj=f, mode="w", format=_FMT) as tar:
        for p in files:
            with p.open("rb") as data:
                _add_aligned(tar, _info(p.name, p.stat().st_size, p.stat().st_mtime), data)
        body = json.dumps(meta).encode()
        _add_aligned(tar, _info(META, len(body)), io.BytesIO(body))
        f.flush()


def _safe_name(name: str) -> str | None:
    """The member's path relative to the image directory; None for the directory itself."""
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name or "\0" in name:
        raise ImageInvalid(f"member name {name!r} leaves the image directory")
    rel = str(p)
    return None if rel in ("", ".") else rel


def _extract(tar: tarfile.TarFile, into: Path) -> dict[str, int]:
    got: dict[str, int] = {}
    for m in tar:
        if m.name == PAD and m.isfile():
            continue
        rel = _safe_name(m.name)
        if m.isdir():
            if rel:
                (into / rel).mkdir(parents=True, exist_ok=True)
            continue
        if not m.isfile() or rel is None:
            raise ImageInvalid(f"member {m.name!r} is not a regular file (links and devices are refused)")
        if rel in got:
            raise ImageInvalid(f"member {m.name!r} appears twice")
        dest = into / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        src = tar.extractfile(m)
        assert src is not None
        with dest.open("xb") as out:
            shutil.copyfileobj(src, out)
        if dest.stat().st_size != m.size:
            raise ImageInvalid(f"member {m.name!r} is truncated")
        got[rel] = m.size
    return got


def _read_meta(into: Path, got: dict[str, int]) -> dict[str, Any]:
    if META not in got:
        raise ImageInvalid(f"no {META} (not a pod image, or truncated)")
    try:
        meta = json.loads((into / META).read_text())
    except ValueError:
        raise ImageInvalid(f"{META} is not JSON") from None
    if not isinstance(meta, dict):
        raise ImageInvalid(f"{META} is not an object")
    if meta.get("format", 1) >= 2:
        listed = meta.get("files")
        unpacked = {k: v for k, v in got.items() if k != META}
        if listed != unpacked:
            raise ImageInvalid("the files unpacked are not those the image lists (truncated?)")
    return meta


def unpack(archive: Path, into: Path) -> dict[str, Any]:
    """Unpack ``archive`` (format 2, or a format-1 ``.tar.zst``) into the new directory ``into``; its meta."""
    into.mkdir(parents=True)
    with archive.open("rb") as f:
        compressed = f.read(4) == ZSTD_MAGIC
    try:
        if not compressed:
            with tarfile.open(archive, mode="r|") as tar:
                return _read_meta(into, _extract(tar, into))
        with subprocess.Popen(["zstd", "-q", "-d", "-c", str(archive)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL) as z:
            assert z.stdout is not None
            try:
                with tarfile.open(fileobj=z.stdout, mode="r|") as tar:
                    got = _extract(tar, into)
            finally:
                z.stdout.close()
            if z.wait() != 0:
                raise ImageInvalid("its zstd stream is damaged")
            return _read_meta(into, got)
    except (tarfile.TarError, EOFError) as e:
        raise ImageInvalid(f"a malformed or truncated archive ({e})") from None
