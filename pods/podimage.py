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

import errno
import hashlib
import json
import mmap
import os
import shutil
import subprocess
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any, Literal

ALIGN = 4096
BLOCK = tarfile.BLOCKSIZE
PAD = ".pad"
META = "pod.json"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_FMT: Literal[2] = tarfile.PAX_FORMAT


class ImageInvalid(Exception):
    """The archive is not a pod image this code can unpack safely."""


def _info(name: str, size: int, mtime: float = 0.0) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = size, 0o600, int(mtime)
    return ti


def _copy_range(src: int, dst: int, size: int, offset: int = 0) -> int:
    """Copy ``size`` bytes of ``src`` from ``offset`` to ``dst``'s position, in the kernel
    (``copy_file_range``; ``sendfile`` where the file systems differ): the data never passes through
    Python (~40 % less time than read/write under TCG for CRIU's page images). The bytes copied: fewer
    only where ``src`` ends early."""
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src, dst, size - done, offset + done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            n = os.sendfile(dst, src, offset + done, size - done)
        if n == 0:
            break
        done += n
    return done


class _Writer:
    """A format-2 archive written straight to a file descriptor: headers from tarfile, data by
    :func:`_copy_range`, every member's data at a multiple of ALIGN (a ``PAD`` member before it)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.offset = fd, 0

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self.offset += len(data)

    def _header(self, ti: tarfile.TarInfo) -> None:
        head = ti.tobuf(_FMT, "utf-8", "surrogateescape")
        gap = (-(self.offset + len(head))) % ALIGN
        if gap:  # a multiple of 512: one header block and gap - 512 bytes of zeros
            self._write(_info(PAD, gap - 512).tobuf(_FMT, "utf-8", "surrogateescape") + bytes(gap - 512))
        assert (self.offset + len(head)) % ALIGN == 0
        self._write(head)

    def _end_member(self, size: int) -> None:
        self._write(bytes(-size % BLOCK))

    def add_file(self, path: Path) -> None:
        st = path.stat()
        self._header(_info(path.name, st.st_size, st.st_mtime))
        src = os.open(path, os.O_RDONLY)
        try:
            copied = _copy_range(src, self.fd, st.st_size)
        finally:
            os.close(src)
        if copied != st.st_size:
            raise OSError(f"{path.name} shrank while it was archived")
        self.offset += copied
        self._end_member(copied)

    def add_bytes(self, name: str, data: bytes) -> None:
        self._header(_info(name, len(data)))
        self._write(data)
        self._end_member(len(data))

    def finish(self) -> None:
        """tarfile's end: two zero blocks, then zeros to a whole record."""
        self._write(bytes(2 * BLOCK))
        self._write(bytes(-self.offset % tarfile.RECORDSIZE))


def pack(images: Path, out: Path, meta: dict[str, Any]) -> None:
    """Write ``images``' files (flat: CRIU's image directory) and ``meta`` as ``pod.json`` into ``out``."""
    files, meta = _members(images, meta)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        w = _Writer(fd)
        for p in files:
            w.add_file(p)
        w.add_bytes(META, json.dumps(meta).encode())
        w.finish()
    finally:
        os.close(fd)


CHUNK = 4 << 20   # a direct write's size: whole sectors, from a page-aligned buffer


class _DeviceWriter(_Writer):
    """A format-2 archive written to a block device (the host's lent disk) through a page-aligned buffer
    in whole chunks, so the device can be opened ``O_DIRECT`` (no page cache to fill and flush), with the
    archive's MD5 taken on the way: the data is read once, hashed and written, with no second pass. The
    archive's length is a whole tar record (a multiple of 512), so its last write is whole sectors too."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.md5 = hashlib.md5(usedforsecurity=False)
        self.buf = mmap.mmap(-1, CHUNK)
        self.view = memoryview(self.buf)
        self.fill = 0

    def _flush(self) -> None:
        done = 0
        while done < self.fill:
            done += os.write(self.fd, self.view[done:self.fill])
        self.fill = 0

    def _write(self, data: bytes) -> None:
        src = memoryview(data)
        self.md5.update(src)
        self.offset += len(src)
        while src:
            n = min(len(src), CHUNK - self.fill)
            self.view[self.fill:self.fill + n] = src[:n]
            self.fill += n
            src = src[n:]
            if self.fill == CHUNK:
                self._flush()

    def add_file(self, path: Path) -> None:
        st = path.stat()
        self._header(_info(path.name, st.st_size, st.st_mtime))
        copied = 0
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(self.view[self.fill:]):
                self.md5.update(self.view[self.fill:self.fill + n])
                self.fill += n
                copied += n
                if self.fill == CHUNK:
                    self._flush()
        if copied != st.st_size:
            raise OSError(f"{path.name} changed size while it was archived")
        self.offset += copied
        self._end_member(copied)

    def finish(self) -> None:
        super().finish()
        self._flush()
        self.view.release()
        self.buf.close()


def _members(images: Path, meta: dict[str, Any]) -> tuple[list[Path], dict[str, Any]]:
    files = sorted(p for p in images.iterdir() if p.is_file() and p.name != META)
    return files, {**meta, "files": {p.name: p.stat().st_size for p in files}}


def pack_to(device: str | Path, images: Path, meta: dict[str, Any]) -> tuple[int, str]:
    """Write the archive of ``images`` and ``meta`` (as :func:`pack`) from the start of ``device`` (a block
    device, or a file standing in for one), flushed to it; its size and MD5. The device is opened
    ``O_DIRECT`` where it allows (a file system that does not — tmpfs — gets plain writes and fsync)."""
    files, meta = _members(images, meta)
    try:
        fd = os.open(device, os.O_WRONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fd = os.open(device, os.O_WRONLY)
    try:
        w = _DeviceWriter(fd)
        for p in files:
            w.add_file(p)
        w.add_bytes(META, json.dumps(meta).encode())
        w.finish()
        os.fsync(fd)
    finally:
        os.close(fd)
    return w.offset, w.md5.hexdigest()


def _md5_of(fd: int, size: int) -> tuple[int, str]:
    """The MD5 of the first ``size`` bytes of ``fd`` and how many there were (fewer where it ends first),
    read in whole chunks into one buffer: the pages stay in the cache for the unpack that follows."""
    md5 = hashlib.md5(usedforsecurity=False)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    done = 0
    while done < size:
        n = os.preadv(fd, [view[:min(CHUNK, size - done)]], done)
        if n == 0:
            break
        md5.update(view[:n])
        done += n
    return done, md5.hexdigest()


def unpack_from(device: str | Path, size: int, md5: str, into: Path) -> dict[str, Any]:
    """Unpack the format-2 archive of ``size`` bytes at the start of ``device`` into the new directory
    ``into``; its meta. Its MD5 is checked first (one read; the unpack then copies from the cache in the
    kernel), so a device that ends before ``size``, a wrong MD5 (or size), or any of :func:`unpack`'s
    refusals raise :class:`ImageInvalid` and leave no ``into``."""
    if size <= 0 or size % BLOCK:
        raise ImageInvalid(f"an archive's size is a positive multiple of {BLOCK}, not {size}")
    with open(device, "rb") as f:
        got, theirs = _md5_of(f.fileno(), size)
        if got != size:
            raise ImageInvalid(f"the device ended at {got} of the archive's {size} bytes")
        if theirs != md5.lower():
            raise ImageInvalid(f"its MD5 is {theirs}, not {md5} (damaged on the way, or a wrong size)")
        into.mkdir(parents=True)
        try:
            with tarfile.open(fileobj=f, mode="r:") as tar:
                return _read_meta(into, _extract(tar, into, f.fileno()))
        except (tarfile.TarError, EOFError) as e:
            shutil.rmtree(into, ignore_errors=True)
            raise ImageInvalid(f"a malformed or truncated archive ({e})") from None
        except BaseException:
            shutil.rmtree(into, ignore_errors=True)
            raise


def _safe_name(name: str) -> str | None:
    """The member's path relative to the image directory; None for the directory itself."""
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name or "\0" in name:
        raise ImageInvalid(f"member name {name!r} leaves the image directory")
    rel = str(p)
    return None if rel in ("", ".") else rel


def _extract(tar: tarfile.TarFile, into: Path, src: int | None = None) -> dict[str, int]:
    """Unpack ``tar``'s members into ``into``: their data copied in the kernel from the archive's file
    descriptor ``src`` where it is given (a seekable, uncompressed archive), else read through tarfile."""
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
        with dest.open("xb") as out:
            if src is not None:
                _copy_range(src, out.fileno(), m.size, m.offset_data)
            else:
                data = tar.extractfile(m)
                assert data is not None
                shutil.copyfileobj(data, out)
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
            with archive.open("rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
                return _read_meta(into, _extract(tar, into, f.fileno()))
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
