"""The host's choice of path for a pod image, against a fake guest agent whose pod layer runs the real
``pods.podimage`` on the host's own file standing in for the lent disk: a pod layer offering "direct"
packs the image straight onto the lent disk (no file in the guest, no dd, no base64) and unpacks it
straight from one; an image damaged on the way is refused and the pod restarted from its kept dump; a pod
layer before "direct" (its command line refuses ``--to`` / ``--size``) gets today's path through a file."""

from __future__ import annotations

import base64
import hashlib
import itertools
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from capsule import capsules
from capsule.agent.app import create_app
from capsule.pod import ops
from capsule.pod.errors import PodFailed
from capsule.pod.relay import Relay
from capsule.store import Store
from capsule.store.catalogue import InstanceRow
from pods import podimage
from tests.unit.test_dashboard_api import TOKEN, _fake_image
from tests.unit.test_guest_replies import (
    GOOD_PATH,
    OLD_LAYER_REFUSES,
    Lent,
    checkpoint_result,
    done,
    guest,
    made_files,
    pods_says,
)
from tests.unit.test_pod_image import META

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

DUMP = "web-20250101T120000-42"
POD = {"name": "web", "ip": "10.77.0.5/24", "state": "running", "seconds": 0.1}
PODS = ["python3", "-m", "pods"]
_n = itertools.count()


def criu_dir(tmp_path: Path) -> Path:
    """A dump big enough to be lent a disk both ways (over 2 MiB)."""
    d = tmp_path / "dump"
    d.mkdir(exist_ok=True)
    (d / "pages-1.img").write_bytes(bytes(range(256)) * (12 << 10))
    (d / "core-1.img").write_bytes(b"core" * 300)
    return d


def direct_layer(tmp_path: Path, damage: bool = False):
    """A pod layer 0.2.0: ``checkpoint --to DEVICE`` packs onto the device, ``restore DEVICE --size --md5``
    unpacks from it (the host's file: the fake lent disk's device is its path)."""
    unpacked: list[Path] = []

    def answer(argv: list[str], _args: dict[str, Any]) -> Any:
        if argv[:4] == [*PODS, "checkpoint"] and "--to" in argv:
            size, md5 = podimage.pack_to(argv[argv.index("--to") + 1], criu_dir(tmp_path), META)
            return pods_says(checkpoint_result(path=None, dump=DUMP, size=size, md5="0" * 32 if damage else md5))
        if argv[:4] == [*PODS, "restore"] and "--md5" in argv:
            into = tmp_path / f"unpacked-{next(_n)}"
            podimage.unpack_from(argv[4], int(argv[argv.index("--size") + 1]), argv[argv.index("--md5") + 1], into)
            unpacked.append(into)
            return pods_says(POD)
        if argv[:4] == [*PODS, "restore-dump"]:
            return pods_says(POD)
        return done()
    answer.unpacked = unpacked  # type: ignore[attr-defined]
    return answer


@pytest.fixture
def store(tmp_path):
    """A store with the running capsule ``deb`` (256 MiB), whose guest agent's socket the fakes serve."""
    s = Store.open(tmp_path / "store")
    _fake_image(s)
    capsules.create(s, "deb", "img", memory="256M")
    inst = s.instance_dir("deb")
    inst.mkdir(parents=True)
    s.catalogue.add_instance(InstanceRow(capsule="deb", version=1, domain="d-deb", leaves=[], chains=[],
                                         accel="tcg", dir=str(inst)))
    yield s
    s.close()


@pytest.fixture
def lent(monkeypatch) -> list[int]:
    sizes: list[int] = []
    monkeypatch.setattr(Relay, "_lend", lambda self, path, writable: Lent(path, sizes))
    return sizes


def no_copy_in_the_guest(fake) -> None:
    assert fake.ran("dd ") == [] and fake.ran("base64") == [] and fake.ran("md5sum") == []
    assert fake.ran("/var/lib/pods/out") == [] and fake.ran("/var/lib/pods/in") == []


def test_a_direct_pod_layer_packs_onto_the_lent_disk_and_the_host_seals_what_it_checked(store, tmp_path, lent):
    fake = guest(store, direct_layer(tmp_path))
    ck = ops.checkpoint(store, "deb/web")
    podimage.pack(criu_dir(tmp_path), tmp_path / "ref.pod", META)
    assert ck.copy_route == "direct" and ck.copy_calls == 1
    assert store.file_path(ck.image).read_bytes() == (tmp_path / "ref.pod").read_bytes()
    assert store.catalogue.file(ck.image).role == "pod-image"
    assert fake.argvs[0][:6] == [*PODS, "checkpoint", "web", "--to"]
    assert fake.argvs[-1] == ["sh", "-c", f"rm -rf /var/lib/pods/dump/{DUMP}"]   # the kept dump goes
    assert fake.ran("restore") == []
    no_copy_in_the_guest(fake)
    assert made_files(store) == []   # the lent disk's file became the image


@pytest.mark.parametrize("leave_running", [False, True])
def test_an_image_damaged_on_the_lent_disk_is_refused_and_the_pod_runs_on_from_its_dump(store, tmp_path, lent,
                                                                                       leave_running):
    fake = guest(store, direct_layer(tmp_path, damage=True))
    with pytest.raises(PodFailed, match="damaged on the lent disk"):
        ops.checkpoint(store, "deb/web", leave_running=leave_running)
    assert [f for f in store.catalogue.files() if f.role == "pod-image"] == [] and made_files(store) == []
    if leave_running:   # it never stopped: its dump just goes
        assert fake.ran("restore-dump") == [] and fake.argvs[-1] == ["sh", "-c", f"rm -rf /var/lib/pods/dump/{DUMP}"]
    else:
        assert [*PODS, "restore-dump", DUMP] in fake.argvs and fake.ran("rm -rf") == []


def test_an_old_pod_layer_gets_the_image_through_a_file(store, lent):
    data = b"an image of format 2" * 50

    def old(argv: list[str], _args: dict[str, Any]) -> Any:
        if "--to" in argv:
            return OLD_LAYER_REFUSES
        if argv[:4] == [*PODS, "checkpoint"]:
            return pods_says(checkpoint_result(size=len(data)))
        if argv[:2] == ["sh", "-c"] and argv[2].startswith("dd "):
            return done(base64.b64encode(data).decode())
        if argv[:2] == ["sh", "-c"] and argv[2].startswith("sha256sum"):
            return done(hashlib.sha256(data).hexdigest() + "  x\n")
        return done()

    fake = guest(store, old)
    ck = ops.checkpoint(store, "deb/web")
    assert ck.copy_route == "file" and store.file_path(ck.image).read_bytes() == data
    assert [a[:4] for a in fake.argvs[:2]] == [[*PODS, "checkpoint"]] * 2 and "--to" not in fake.argvs[1]
    assert ["sh", "-c", f"rm -f {GOOD_PATH}"] in fake.argvs and fake.ran("restore") == []


def _sealed(store, tmp_path: Path) -> str:
    podimage.pack(criu_dir(tmp_path), tmp_path / "img.pod", META)
    row = store.seal_file(tmp_path / "img.pod", ops.ROLE)
    with store.catalogue.transaction():
        store.catalogue.add_file(row)
    return row.id


def _restore(store, image: str) -> dict[str, Any]:
    client = TestClient(create_app(store.home, TOKEN))
    r = client.post("/v1/pods/restore", json={"image": image, "into": "deb"},
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_direct_pod_layer_restores_straight_from_the_lent_disk_through_the_agent(store, tmp_path, lent):
    image = _sealed(store, tmp_path)
    answer = direct_layer(tmp_path)
    fake = guest(store, answer)
    got = _restore(store, image)
    assert got["copy_route"] == "direct" and got["state"] == "running"
    size = store.file_path(image).stat().st_size
    md5 = hashlib.md5(store.file_path(image).read_bytes()).hexdigest()
    (restore,) = fake.ran("restore")
    assert restore[5:] == ["--size", str(size), "--md5", md5] and lent == [-(-size // 512) * 512]
    assert (answer.unpacked[0] / "pages-1.img").read_bytes() == (criu_dir(tmp_path) / "pages-1.img").read_bytes()
    no_copy_in_the_guest(fake)


def test_an_old_pod_layer_restores_from_a_file_copied_in(store, tmp_path, lent):
    image = _sealed(store, tmp_path)
    data = store.file_path(image).read_bytes()

    def old(argv: list[str], _args: dict[str, Any]) -> Any:
        if "--size" in argv:
            return OLD_LAYER_REFUSES
        if argv[:2] == ["sh", "-c"] and " dd if=" in argv[2]:
            return done(hashlib.md5(data).hexdigest() + "  x.part\n")
        if argv[:4] == [*PODS, "restore"]:
            return pods_says(POD)
        return done()

    fake = guest(store, old)
    got = _restore(store, image)
    assert got["copy_route"] == "file"
    assert fake.argvs[-2] == [*PODS, "restore", f"/var/lib/pods/in/{image}.pod"]
    assert len(fake.ran(" dd if=")) == 1 and len(lent) == 2   # one disk refused, one for today's copy
