"""A pod image straight on a block device (the disk the host lends): ``pack_to`` writes the format-2
archive from the device's start — byte for byte what ``pack`` writes to a file — and answers its size and
MD5; ``unpack_from`` checks the MD5 of the first SIZE bytes, then unpacks them, and refuses a wrong MD5,
a size cut short or a device that ends early with nothing left behind. A regular file stands in for the
device here."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pods import __main__ as cli
from pods import podimage
from tests.unit.test_pod_image import META, criu_like

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def device(tmp_path: Path, size: int = 4 << 20) -> Path:
    """A 'device' holding stale bytes, as a disk reused would: nothing of them may leak into the image."""
    dev = tmp_path / "dev"
    dev.write_bytes(b"\xa5" * size)
    return dev


def test_pack_to_writes_the_archive_pack_writes_from_offset_0_with_its_size_and_md5(tmp_path):
    files = criu_like(tmp_path / "dump")
    dev = device(tmp_path)
    size, md5 = podimage.pack_to(dev, tmp_path / "dump", META)
    podimage.pack(tmp_path / "dump", tmp_path / "ref.pod", META)
    ref = (tmp_path / "ref.pod").read_bytes()
    on_device = dev.read_bytes()
    assert size == len(ref) and size % 512 == 0 and on_device[:size] == ref
    assert md5 == hashlib.md5(ref).hexdigest()
    assert on_device[size:] == b"\xa5" * (len(on_device) - size)   # past the image: untouched

    meta = podimage.unpack_from(dev, size, md5, tmp_path / "out")
    assert meta["name"] == "web" and meta["files"] == {k: len(v) for k, v in files.items()}
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.name != "pod.json"} == files


def test_pack_to_spans_several_direct_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(podimage, "CHUNK", 8192)   # the buffer fills and flushes many times over
    criu_like(tmp_path / "dump")
    dev = device(tmp_path)
    size, md5 = podimage.pack_to(dev, tmp_path / "dump", META)
    podimage.pack(tmp_path / "dump", tmp_path / "ref.pod", META)
    assert dev.read_bytes()[:size] == (tmp_path / "ref.pod").read_bytes()
    assert md5 == hashlib.md5((tmp_path / "ref.pod").read_bytes()).hexdigest()


@pytest.mark.parametrize("how", ["md5", "short", "long", "past-the-device", "odd"])
def test_a_wrong_md5_or_size_is_refused_and_nothing_is_unpacked(tmp_path, how):
    criu_like(tmp_path / "dump")
    dev = device(tmp_path, 1 << 20)
    size, md5 = podimage.pack_to(dev, tmp_path / "dump", META)
    given = {"md5": (size, "0" * 32), "short": (size - 10240, md5), "long": (size + 512, md5),
             "past-the-device": (2 << 20, md5), "odd": (size - 1, md5)}[how]
    with pytest.raises(podimage.ImageInvalid, match="MD5|truncated|ended at|multiple of 512"):
        podimage.unpack_from(dev, *given, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_line_offers_direct_and_wants_both_size_and_md5(tmp_path, capsys):
    assert cli.main(["version"]) == 0
    assert "direct" in json.loads(capsys.readouterr().out)["result"]["features"]
    assert cli.main(["restore", str(tmp_path / "dev"), "--size", "512"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and "--size and --md5" in out["error"]
    args = cli.parser().parse_args(["checkpoint", "web", "--to", "/dev/vdz"])
    assert args.to == "/dev/vdz"
