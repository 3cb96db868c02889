"""Bad input on real guests: corrupt qcow2, tampered layer and memory image,
a full disk during suspend. Each gets a clear error and changes nothing."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from capsule import capsules, lifecycle
from capsule.errors import IntegrityError, StorageFull
from capsule.runtime.connection import lookup_domain
from capsule.verify import verify
from hashcache.qcow2 import Qcow2Image
from testkit.images import make_store
from tests.helpers.guest import COUNTER, run, wait_count_above, write_blocks

pytestmark = pytest.mark.vm


def _snapshot_state(store):
    return ([v.ref for v in store.catalogue.versions()], store.catalogue.instances(),
            sorted(p.name for p in store.layers_dir.iterdir()), sorted(p.name for p in store.files_dir.iterdir()))


def _flip(path, offset):
    """Flip one byte of a sealed object, leaving its mode as it was (verify checks modes too)."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    os.chmod(path, mode)


def _child_layer(store, name):
    capsules.create(store, name, "tiny", memory="256M")
    lifecycle.start(store, name)
    write_blocks(store, name, 40, 4)
    lifecycle.stop(store, name, force=True)
    return store.catalogue.latest_version(name).chains[0][-1]


def test_tampered_layer_is_named_by_verify(store):
    layer = _child_layer(store, "t")
    path = store.layer_path(layer)
    with Qcow2Image(path) as img:
        index, _kind, offset = next(b for b in img.iter_blocks() if b[2])
    _flip(path, offset + 100)
    report = verify(store)
    assert not report.ok
    [problem] = report.problems
    assert problem.kind == "layer" and problem.id == layer
    assert f"block {index}" in problem.error


def test_corrupt_qcow2_refused_at_start_and_named_by_verify(store):
    layer = _child_layer(store, "q")
    path = store.layer_path(layer)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.write(b"\x00" * 64)  # destroy the header
    os.chmod(path, mode)
    before = _snapshot_state(store)
    with pytest.raises(IntegrityError, match=layer[:12]):
        lifecycle.start(store, "q")
    assert _snapshot_state(store) == before
    assert lookup_domain(store.domain_name("q")) is None
    report = verify(store)
    assert [p.id for p in report.problems] == [layer]


def test_tampered_memory_image_refused_and_named(store):
    capsules.create(store, "m", "tiny", memory="256M")
    lifecycle.start(store, "m")
    sealed = lifecycle.suspend(store, "m")
    mem = sealed.memory
    manifest = store.file_manifest(mem.id)
    index = next(i for i, is_zero, _h in manifest.records() if not is_zero and i > 100)
    _flip(store.file_path(mem.id), index * 4096 + 7)
    before = _snapshot_state(store)
    with pytest.raises(IntegrityError, match=f"block {index}"):
        lifecycle.start(store, "m")
    assert _snapshot_state(store) == before
    report = verify(store)
    assert [(p.kind, p.id) for p in report.problems] == [("memory", mem.id)]


def test_full_disk_during_suspend_changes_nothing(tmp_path, tiny_images):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], check=True)
    try:
        store = make_store(mnt / "store", tiny_images, "tiny")
        capsules.create(store, "f", "tiny", memory="256M")
        lifecycle.start(store, "f")
        run(store, "f", COUNTER)
        # fill the file system, leaving a few MiB: far less than the memory image needs
        filler = mnt / "filler"
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        with open(filler, "wb") as f:
            f.write(b"\1" * max(0, free - (4 << 20)))
        before = _snapshot_state(store)
        with pytest.raises(StorageFull):
            lifecycle.suspend(store, "f")
        # the guest keeps running, nothing was recorded, nothing half-written is left
        assert lookup_domain(store.domain_name("f")) is not None
        n = wait_count_above(store, "f", 0)
        assert wait_count_above(store, "f", n) > n
        assert _snapshot_state(store) == before
        assert list(store.tmp_dir.iterdir()) == []
        # with space again, the same capsule suspends fine
        filler.unlink()
        sealed = lifecycle.suspend(store, "f")
        assert sealed.version is not None and sealed.version.number == 2
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
