"""A real guest's QEMU runs as the unprivileged guest user (``capsule/runtime/guestaccess.py``). The guest boots,
writes its disk, and is suspended and restored. Meanwhile that user cannot write a sealed layer, cannot read a
memory image or the catalogue, and cannot list the store or enter its private directories."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from capsule import capsules, lifecycle
from capsule.runtime.guestaccess import guest_user
from tests.helpers.guest import disk_digest, write_blocks

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]


def _as_guest_user(script: str) -> subprocess.CompletedProcess[str]:
    u = guest_user()
    return subprocess.run(["setpriv", f"--reuid={u.uid}", f"--regid={u.gid}", "--init-groups", "sh", "-c", script],
                          capture_output=True, text=True, timeout=30)


def _ids(pid: int) -> tuple[set[int], set[int]]:
    lines = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {int(x) for x in lines["Uid"].split()}, {int(x) for x in lines["Gid"].split()}


def test_qemu_runs_unprivileged_and_reaches_only_what_its_guest_needs(store):
    user = guest_user()
    assert not user.unconfined, "the test host must have libvirt's unprivileged user (make setup)"
    capsules.create(store, "c", "tiny", memory="256M")
    lifecycle.start(store, "c")
    pid = int(Path(f"/run/libvirt/qemu/{store.domain_name('c')}.pid").read_text())
    assert _ids(pid) == ({user.uid}, {user.gid})

    write_blocks(store, "c", 100, 64)              # the guest writes its leaf (read-write through the group)
    written = disk_digest(store, "c")
    inst = store.catalogue.instance("c")
    assert inst is not None
    leaf = Path(inst.leaves[0])
    base = store.layer_path(inst.chains[0][-1])

    assert _as_guest_user(f"head -c 4096 {base} >/dev/null").returncode == 0      # a layer of its chain: read
    refused = _as_guest_user(f": >> {base}")                                       # … never written
    assert refused.returncode != 0 and "Permission denied" in refused.stderr
    assert _as_guest_user(f"ls {store.layers_dir}").returncode != 0                # no listing of the store
    for private in (store.home / "catalogue.sqlite", store.home / "store.json", store.tmp_dir / "."):
        assert _as_guest_user(f"cat {private} >/dev/null").returncode != 0, private

    sealed = lifecycle.suspend(store, "c")
    assert sealed.memory is not None
    memory = store.file_path(sealed.memory.id)
    assert _as_guest_user(f"head -c 1 {memory} >/dev/null").returncode != 0       # guest RAM: root's alone
    assert _as_guest_user(f": >> {leaf}").returncode != 0 or not leaf.exists()     # the old leaf is sealed now

    restored = lifecycle.start(store, "c")
    assert restored.mode == "restore"
    assert disk_digest(store, "c") == written
    pid = int(Path(f"/run/libvirt/qemu/{store.domain_name('c')}.pid").read_text())
    assert _ids(pid) == ({user.uid}, {user.gid})
