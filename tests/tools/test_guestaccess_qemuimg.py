"""A leaf QEMU's own tool wrote with a backing file outside the store (``qemu-img create -b /…/shadow -F raw``,
as an escaped QEMU could rewrite its leaf's header): starting a guest on it is refused, and the file outside
keeps its owner, group and mode. Runs qemu-img."""

from __future__ import annotations

import stat
import subprocess

import pytest

from capsule.errors import IntegrityError
from capsule.runtime.guestaccess import GuestUser, grant_machine
from capsule.store import Store

pytestmark = [pytest.mark.tools, pytest.mark.timeout(60)]

GUEST = GuestUser("guest", 64999, 64998)


def test_a_leaf_backed_by_a_file_outside_the_store_is_refused(tmp_path):
    store = Store.open(tmp_path / "store")
    try:
        secret = tmp_path / "etc" / "shadow"
        secret.parent.mkdir()
        secret.write_bytes(b"root:secret\n" * 100)
        secret.chmod(0o600)
        kernel, initrd = store.files_dir / "kernel", store.files_dir / "initrd"
        for p in (kernel, initrd):
            p.write_bytes(b"k")
        inst = store.instances_dir / "c"
        inst.mkdir()
        leaf = store.layers_dir / "leaf-1.qcow2"
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(secret), "-F", "raw", str(leaf)],
                       check=True)
        before = {p: (p.stat().st_gid, stat.S_IMODE(p.stat().st_mode)) for p in (secret, store.home, kernel, leaf)}
        with pytest.raises(IntegrityError, match=f"names '{secret}' as its backing file"):
            grant_machine(store.home, kernel=kernel, initrd=initrd, leaves=[leaf], instance_dir=inst, user=GUEST,
                          chains=[[]])
        assert {p: (p.stat().st_gid, stat.S_IMODE(p.stat().st_mode)) for p in before} == before
    finally:
        store.close()
