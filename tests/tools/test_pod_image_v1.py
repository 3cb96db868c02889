"""A format-1 pod image (``tar | zstd -3``, made before images were aligned for dedup) still unpacks, and
the host reads its address; a damaged one is refused. Runs tar and zstd."""

from __future__ import annotations

import json
import subprocess

import pytest

from capsule.pod.network import image_address
from pods import podimage
from tests.unit.test_pod_image import META, criu_like

pytestmark = [pytest.mark.tools, pytest.mark.timeout(60)]


def test_a_format_1_tar_zst_still_unpacks(tmp_path):
    files = criu_like(tmp_path / "dump")
    (tmp_path / "dump" / "pod.json").write_text(json.dumps(META | {"format": 1}))
    old = tmp_path / "old.tar.zst"
    subprocess.run(f"tar -C {tmp_path / 'dump'} -cf - . | zstd -q -3 -o {old}", shell=True, check=True)
    meta = podimage.unpack(old, tmp_path / "back")
    assert meta["format"] == 1
    assert all((tmp_path / "back" / n).read_bytes() == d for n, d in files.items())
    assert image_address(old) == "10.77.0.5"
    damaged = tmp_path / "damaged.tar.zst"
    damaged.write_bytes(old.read_bytes()[:len(old.read_bytes()) // 2])
    with pytest.raises(podimage.ImageInvalid):
        podimage.unpack(damaged, tmp_path / "back2")
