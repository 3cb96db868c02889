"""A pod image's pod.json is read on the host within bounds (capsule/pod/imagemeta.py): a pod.json of gigabytes
(zstd of zeros is a few bytes a gigabyte), an extended tar header of as much, or an archive that takes too long to
read through is refused quickly, with memory that does not grow with what the archive claims or holds."""

from __future__ import annotations

import json
import tarfile
import time
from pathlib import Path

import pytest
import zstandard

from capsule.errors import IntegrityError
from capsule.pod import imagemeta
from capsule.pod.imagemeta import image_address
from tests.helpers.fuzzing import peak_allocation

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

ZEROS = 64 << 20
META = json.dumps({"format": 1, "name": "web", "ip": "10.77.0.5/24"}).encode()


def _header(name: str, size: int, fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode = size, 0o600
    return ti.tobuf(fmt)


def _zeros_frames(size: int) -> bytes:
    """zstd frames that decompress to ``size`` zero bytes (a multiple of ZEROS): one frame, repeated."""
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(ZEROS))
    return frame * (size // ZEROS)


def format1(tmp_path: Path, members: list[tuple[str, int | bytes]]) -> Path:
    """A ``.tar.zst`` (format 1) of ``members``: (name, its bytes or a size of zeros), made of zstd frames so a
    member of gigabytes costs kilobytes here."""
    c = zstandard.ZstdCompressor(level=1)
    out = bytearray()
    for name, data in members:
        size = data if isinstance(data, int) else len(data)
        out += c.compress(_header(name, size))
        if isinstance(data, int):
            out += _zeros_frames(size)
        else:
            out += c.compress(data + bytes(-len(data) % 512))
    out += c.compress(bytes(1024))
    path = tmp_path / "image.tar.zst"
    path.write_bytes(out)
    return path


def test_a_sane_format_1_image_still_gives_its_address(tmp_path):
    assert image_address(format1(tmp_path, [("./pages-1.img", b"p" * 5000), ("./pod.json", META)])) == "10.77.0.5/24"


@pytest.mark.parametrize("size", [ZEROS, 4 << 30])   # 64 MiB, and 4 GiB from ~200 KB of file
def test_a_huge_pod_json_is_refused_quickly_and_in_bounded_memory(tmp_path, size):
    image = format1(tmp_path, [("./pod.json", size)])
    assert image.stat().st_size < 1 << 20
    t0 = time.monotonic()
    peak = peak_allocation(lambda: image_address(image))
    assert time.monotonic() - t0 < 10
    assert peak < 8 << 20, f"{peak} bytes at the peak"
    with pytest.raises(IntegrityError, match=f"its pod.json is {size} bytes, more than {imagemeta.POD_JSON_MAX}"):
        image_address(image)


def test_a_huge_extended_header_is_refused_before_it_is_read(tmp_path):
    # a pax header claiming 2 GiB of attributes (tarfile would read them all into memory)
    ti = tarfile.TarInfo("./PaxHeaders/pod.json")
    ti.type, ti.size = tarfile.XHDTYPE, 2 << 30
    blob = ti.tobuf(tarfile.USTAR_FORMAT)
    c = zstandard.ZstdCompressor(level=1)
    image = tmp_path / "pax.tar.zst"
    image.write_bytes(c.compress(blob) + _zeros_frames(2 << 30) + c.compress(_header("./pod.json", len(META))
                                                                               + META + bytes(-len(META) % 512)))
    peak = peak_allocation(lambda: image_address(image))
    assert peak < 8 << 20, f"{peak} bytes at the peak"
    with pytest.raises(IntegrityError, match="extended tar header"):
        image_address(image)


def test_reading_stops_at_the_deadline(tmp_path, monkeypatch):
    """Gigabytes of zeros before pod.json: read through for POD_JSON_SECONDS at most."""
    image = format1(tmp_path, [("./pages-1.img", 2 << 30), ("./pod.json", META)])

    class Clock:              # a second passes at every read: the deadline falls however fast zeros decompress
        now = 0.0

        def monotonic(self) -> float:
            self.now += 1.0
            return self.now

    monkeypatch.setattr(imagemeta, "time", Clock())
    monkeypatch.setattr(imagemeta, "POD_JSON_SECONDS", 5.0)
    t0 = time.monotonic()
    with pytest.raises(IntegrityError, match="not read through in"):
        image_address(image)
    assert time.monotonic() - t0 < 5


def test_a_format_2_image_with_a_huge_pod_json_is_refused_too(tmp_path):
    image = tmp_path / "image.pod"
    with image.open("wb") as f:
        f.write(_header("pages-1.img", 4096) + bytes(4096))
        f.write(_header("pod.json", 3 << 30))
        f.truncate(f.tell() + (3 << 30) + 1024)   # sparse: 3 GiB of zeros, then the end blocks
    peak = peak_allocation(lambda: image_address(image))
    assert peak < 8 << 20, f"{peak} bytes at the peak"
    with pytest.raises(IntegrityError, match="more than"):
        image_address(image)


def test_an_address_that_is_not_one_is_an_integrity_error(tmp_path):
    for ip in (5, "junk", None, ["10.0.0.1"]):
        image = format1(tmp_path, [("./pod.json", json.dumps({"ip": ip}).encode())])
        with pytest.raises(IntegrityError, match="no pod.json with an address"):
            image_address(image)
