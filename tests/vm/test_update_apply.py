"""Data disks survive system updates, on real Debian guests: a capsule with a data disk (ext4 made in the
guest) moves to a new system version made by update make; booted, it shows the system change and still has
its data file, while what it wrote on its old system disk is gone (the rule). A system not derived from
the current one, and a running capsule without --restart, are refused and change nothing; with --restart
the running capsule is stopped cleanly (its newest data kept), moved, and booted."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from capsule.errors import Conflict
from capsule.update import apply as applying
from capsule.update import make as making
from tests.helpers.guest import run

pytestmark = [pytest.mark.vm, pytest.mark.slow]

MOUNT = "mount /dev/vdb /mnt"


def refs(store, name: str) -> list[str]:
    return [v.ref for v in store.catalogue.versions(name)]


@pytest.mark.timeout(1500)
def test_apply_keeps_the_data_disk_and_brings_the_system_change(debian_store):
    store = debian_store
    capsules.create(store, "web", "debian", memory="512M")
    alice1 = capsules.create(store, "alice", "debian", memory="384M", data_disks=["64M"])
    assert len(alice1.chains) == 2
    lifecycle.start(store, "alice", timeout=300)
    assert run(store, "alice", "cat /sys/block/vdb/size") == str(64 * 2048)
    run(store, "alice", f"mkfs.ext4 -q -F /dev/vdb && {MOUNT} && echo precious > /mnt/file && umount /mnt && sync",
        timeout=120)
    run(store, "alice", "echo mine > /root/on-system-disk; sync")
    alice2 = lifecycle.stop(store, "alice", timeout=120).version
    assert alice2 is not None and alice2.ref == "alice@2"

    made = making.make(store, "web", run=["echo release-2 > /etc/fleet-release"], network=False)
    assert made.version is not None and made.version.ref == "web@2"
    with pytest.raises(applying.NotDerived, match="already runs on that system"):
        applying.apply(store, "alice", "web@1")
    assert refs(store, "alice") == ["alice@1", "alice@2"]

    res = applying.apply(store, "alice", "web@2")
    v = res.version
    assert v.ref == "alice@3" and v.chains[0] == made.version.chains[0] and v.chains[1] == alice2.chains[1]
    assert v.config["memory_mib"] == 384
    assert res.dropped_layers == alice2.chains[0][1:]
    lifecycle.start(store, "alice@3", timeout=300)
    assert run(store, "alice", "cat /etc/fleet-release") == "release-2"
    assert run(store, "alice", f"{MOUNT} && cat /mnt/file") == "precious"
    assert run(store, "alice", "cat /root/on-system-disk 2>/dev/null || echo gone") == "gone"
    run(store, "alice", "echo newer > /mnt/file2 && sync")

    # the next system version, while alice runs: refused without --restart, nothing changes
    assert making.make(store, "web", run=["echo release-3 > /etc/fleet-release"], network=False).version.ref == "web@3"
    with pytest.raises(Conflict, match="alice is running .* give --restart"):
        applying.apply(store, "alice", "web@3")
    assert refs(store, "alice") == ["alice@1", "alice@2", "alice@3"]
    assert store.catalogue.instance("alice") is not None

    res = applying.apply(store, "alice", "web@3", restart=True)
    assert res.restarted and res.before.ref == "alice@4" and res.version.ref == "alice@5"
    assert store.catalogue.instance("alice").version == 5
    assert run(store, "alice", "cat /etc/fleet-release") == "release-3"
    assert run(store, "alice", f"{MOUNT} && cat /mnt/file /mnt/file2") == "precious\nnewer"
