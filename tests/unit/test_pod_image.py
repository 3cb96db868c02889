"""A pod image's archive (format 2): every file's data starts at a 4 KiB offset, so HCP's 4 KiB blocks
line up with CRIU's pages and dedup against an earlier image; pack → unpack gives the same bytes; a
truncated or malformed archive, a member that would leave the image directory (``../x``, an absolute name)
and links are refused; a format-1 ``.tar.zst`` still unpacks; the host reads the address without unpacking."""

from __future__ import annotations

import io
import json
import os
import random
import tarfile
from pathlib import Path

import pytest

from capsule.errors import IntegrityError
from capsule.pod.network import image_address
from pods import podimage

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

META = {"format": 2, "name": "web", "ip": "10.77.0.5", "cmd": ["sleep", "1"], "created": 1.0}


def criu_like(d: Path) -> dict[str, bytes]:
    """A CRIU image directory's shape: odd-sized small images, page images of whole pages, a log."""
    rnd = random.Random(13)
    files = {"core-1.img": rnd.randbytes(1234), "mm-1.img": rnd.randbytes(77), "pagemap-1.img": rnd.randbytes(300),
             "pages-1.img": rnd.randbytes(4096 * 37), "pages-2.img": bytes(4096 * 3) + rnd.randbytes(4096 * 5),
             "inventory.img": b"", "dump.log": b"x" * 5000, "a-name-that-is-rather-long-" * 5 + ".img": b"long"}
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    return files


def test_every_member_data_starts_on_a_4k_boundary_and_round_trips(tmp_path):
    files = criu_like(tmp_path / "dump")
    out = tmp_path / "pod.pod"
    podimage.pack(tmp_path / "dump", out, META)
    with tarfile.open(out) as tar:
        real = [m for m in tar.getmembers() if m.name != podimage.PAD]
        assert [m.name for m in real] == sorted(files) + ["pod.json"]  # pod.json last
        for m in real:
            assert m.offset_data % 4096 == 0, (m.name, m.offset_data)
    raw = out.read_bytes()
    first_page = next(m for m in real if m.name == "pages-1.img")
    assert raw[first_page.offset_data:first_page.offset_data + 4096] == files["pages-1.img"][:4096]
    meta = podimage.unpack(out, tmp_path / "back")
    assert meta == META | {"files": {k: len(v) for k, v in files.items()}}
    for name, data in files.items():
        assert (tmp_path / "back" / name).read_bytes() == data
    assert sorted(os.listdir(tmp_path / "back")) == sorted([*files, "pod.json"])
    assert image_address(out) == "10.77.0.5"


def blocks(b: bytes) -> set[bytes]:
    return {b[i:i + 4096] for i in range(0, len(b), 4096)}


def test_the_same_pages_give_the_same_blocks_in_two_images(tmp_path):
    """The point of the alignment: a second image of the same memory shares its page blocks with the first."""
    files = criu_like(tmp_path / "dump")
    podimage.pack(tmp_path / "dump", tmp_path / "one", META)
    (tmp_path / "dump" / "core-1.img").write_bytes(b"changed" * 300)  # another size: later members shift
    podimage.pack(tmp_path / "dump", tmp_path / "two", META | {"created": 2.0})
    one, two = (blocks((tmp_path / n).read_bytes()) for n in ("one", "two"))
    pages = blocks(files["pages-1.img"])
    assert pages <= one and pages <= two


@pytest.mark.parametrize("cut", [100, 4096, 9000, "pod.json"])
def test_a_truncated_archive_is_refused(tmp_path, cut):
    criu_like(tmp_path / "dump")
    podimage.pack(tmp_path / "dump", tmp_path / "full", META)
    raw = (tmp_path / "full").read_bytes()
    if cut == "pod.json":  # everything but the end of pod.json's data and the archive's end
        with tarfile.open(tmp_path / "full") as tar:
            cut = tar.getmember("pod.json").offset_data + 10
    end = int(cut)
    (tmp_path / "cut").write_bytes(raw[:end])
    with pytest.raises(podimage.ImageInvalid):
        podimage.unpack(tmp_path / "cut", tmp_path / "into")


def test_a_member_dropped_at_a_header_boundary_is_caught_by_the_file_list(tmp_path):
    criu_like(tmp_path / "dump")
    podimage.pack(tmp_path / "dump", tmp_path / "full", META)
    with tarfile.open(tmp_path / "full") as tar, tarfile.open(tmp_path / "less", "w") as less:
        for m in tar.getmembers():
            if m.name != "pages-2.img":
                less.addfile(m, tar.extractfile(m))
    with pytest.raises(podimage.ImageInvalid, match="not those the image lists"):
        podimage.unpack(tmp_path / "less", tmp_path / "into")


def test_garbage_is_refused(tmp_path):
    (tmp_path / "junk").write_bytes(os.urandom(20000))
    with pytest.raises(podimage.ImageInvalid):
        podimage.unpack(tmp_path / "junk", tmp_path / "into")
    with pytest.raises(IntegrityError, match="holds no pod.json"):
        image_address(tmp_path / "junk")


def _hostile(path: Path, member: tarfile.TarInfo, data: bytes = b"x") -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        body = json.dumps(META).encode()
        pj = tarfile.TarInfo("pod.json")
        pj.size = len(body)
        tar.addfile(pj, io.BytesIO(body))
        if member.isfile():
            member.size = len(data)
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, link
    return m


@pytest.mark.parametrize("member", [
    _member("../x"), _member("a/../../x"), _member("/etc/x"), _member("./../x"),
    _member("ln", tarfile.SYMTYPE, "/etc/passwd"), _member("hl", tarfile.LNKTYPE, "pod.json"),
    _member("dev", tarfile.CHRTYPE), _member("fifo", tarfile.FIFOTYPE),
], ids=["dotdot", "nested-dotdot", "absolute", "dot-dotdot", "symlink", "hardlink", "device", "fifo"])
def test_member_names_that_leave_the_directory_and_links_are_refused(tmp_path, member):
    _hostile(tmp_path / "bad", member)
    with pytest.raises(podimage.ImageInvalid):
        podimage.unpack(tmp_path / "bad", tmp_path / "sub" / "into")
    assert not (tmp_path / "x").exists() and not (tmp_path / "sub" / "x").exists()
    assert not (tmp_path / "sub" / "into" / "ln").exists()


@pytest.mark.parametrize("kernel", ["copy_file_range", "sendfile"])
def test_file_data_is_copied_in_the_kernel_both_ways(tmp_path, monkeypatch, kernel):
    """CRIU's page images are not read through Python: pack and unpack move file data with
    copy_file_range, or sendfile where it is refused (another file system); the archive is the same."""
    files = criu_like(tmp_path / "dump")
    podimage.pack(tmp_path / "dump", tmp_path / "first.pod", META)
    moved: dict[str, int] = {"copy_file_range": 0, "sendfile": 0}
    real_cfr, real_sendfile = os.copy_file_range, os.sendfile

    def cfr(*args, **kw):
        if kernel == "sendfile":
            raise OSError(18, "Invalid cross-device link")  # EXDEV
        n = real_cfr(*args, **kw)
        moved["copy_file_range"] += n
        return n

    def sendfile(*args, **kw):
        n = real_sendfile(*args, **kw)
        moved["sendfile"] += n
        return n

    monkeypatch.setattr(podimage.os, "copy_file_range", cfr)
    monkeypatch.setattr(podimage.os, "sendfile", sendfile)
    podimage.pack(tmp_path / "dump", tmp_path / "pod.pod", META)
    data = sum(len(v) for v in files.values())
    assert moved[kernel] == data
    meta = podimage.unpack(tmp_path / "pod.pod", tmp_path / "back")
    assert moved[kernel] == 2 * data + (tmp_path / "back" / "pod.json").stat().st_size
    assert meta["files"] == {k: len(v) for k, v in files.items()}
    for name, body in files.items():
        assert (tmp_path / "back" / name).read_bytes() == body
    assert (tmp_path / "pod.pod").read_bytes() == (tmp_path / "first.pod").read_bytes()
