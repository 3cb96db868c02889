"""A capsule with data disks (capsule create --data-disk) on the tiny guest: the guest sees each as an empty
vdX of its size; suspend seals both leaves with the memory image, the restore (the image's XML with two disks
grafted onto this host's template) finds both disks as they were, and a push carries both chains to another
host, where the version restores with the same data disk content."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle, transfer
from tests.helpers.guest import run

pytestmark = pytest.mark.vm


def vdb_digest(store, name: str) -> str:
    return run(store, name, "echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/vdb bs=4096 count=256 2>/dev/null "
                            "| sha256sum").split()[0]


def test_data_disk_through_suspend_restore_and_push(two_hosts):
    a, b, _agent_a, agent_b = two_hosts
    v1 = capsules.create(a, "box", "tiny", memory="256M", data_disks=["16M", "8M"])
    assert len(v1.chains) == 3
    empty = [a.catalogue.layer(c[0]) for c in v1.chains[1:]]
    assert [e.blocks for e in empty] == [0, 0] and [e.virtual_size for e in empty] == [16 << 20, 8 << 20]
    # one empty layer per size, shared: a second capsule's 16M data disk is the same object
    assert capsules.create(a, "other", "tiny", data_disks=["16M"]).chains[1] == v1.chains[1]

    lifecycle.start(a, "box")
    sizes = run(a, "box", "cat /sys/block/vdb/size /sys/block/vdc/size").split()
    assert sizes == [str(16 << 11), str(8 << 11)]
    assert run(a, "box", "dd if=/dev/vdb bs=4096 count=16 2>/dev/null | tr -d '\\000' | wc -c") == "0"
    run(a, "box", "dd if=/dev/urandom of=/dev/vdb bs=4096 seek=10 count=40 conv=notrunc 2>/dev/null; "
                  "echo on-vdc | dd of=/dev/vdc conv=notrunc 2>/dev/null; sync")
    digest = vdb_digest(a, "box")
    sealed = lifecycle.suspend(a, "box")
    v2 = sealed.version
    assert v2 is not None and v2.memory and len(v2.chains) == 3
    assert v2.chains[1][:-1] == v1.chains[1] and v2.chains[2][:-1] == v1.chains[2], "both data leaves sealed"
    assert a.catalogue.layer(v2.chains[1][-1]).blocks == 40

    assert lifecycle.start(a, "box").mode == "restore"
    assert vdb_digest(a, "box") == digest
    assert run(a, "box", "head -c 6 /dev/vdc") == "on-vdc"
    lifecycle.suspend(a, "box")

    report = transfer.push(a, "box", agent_b.url, agent_b.token)
    assert report.recorded
    there = b.catalogue.latest_version("box")
    assert there.chains == a.catalogue.latest_version("box").chains
    assert lifecycle.start(b, "box").mode == "restore"
    assert vdb_digest(b, "box") == digest
    assert run(b, "box", "head -c 6 /dev/vdc") == "on-vdc"


def test_demand_paged_run_of_a_capsule_with_a_data_disk(tmp_path, tiny_images):
    from testkit.images import destroy_domains, make_store
    from tests.conftest import Agent

    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images)            # holds nothing of the capsule
    agent = Agent(a.home, tmp_path / "a.token")
    try:
        capsules.create(a, "cap", "tiny", memory="256M", data_disks=["16M"])
        lifecycle.start(a, "cap")
        run(a, "cap", "dd if=/dev/urandom of=/dev/vdb bs=4096 seek=5 count=20 conv=notrunc 2>/dev/null; sync")
        digest = vdb_digest(a, "cap")
        lifecycle.stop(a, "cap", force=True)

        r = transfer.run(b, agent.url, "cap", agent.token)
        assert r.start.mode == "boot"
        assert set(r.remote_layers) == a.catalogue.latest_version("cap").layer_ids(), "both disks' chains remote"
        assert vdb_digest(b, "cap") == digest
        run(b, "cap", "echo here | dd of=/dev/vdb bs=4096 seek=1000 conv=notrunc 2>/dev/null; sync")
        stopped = lifecycle.stop(b, "cap", force=True)
        assert stopped.version is not None and len(stopped.version.chains) == 2
        lifecycle.start(b, stopped.version.ref)
        assert run(b, "cap", "dd if=/dev/vdb bs=4096 skip=1000 count=1 2>/dev/null | head -c 4") == "here"
        assert vdb_digest(b, "cap") == digest
        lifecycle.stop(b, "cap", force=True)
    finally:
        agent.stop()
        for s in (a, b):
            destroy_domains(s)
            s.close()


def test_apply_restart_resumes_a_suspended_capsule_stops_it_and_keeps_its_data(store):
    from capsule.update import apply as applying

    capsules.create(store, "sys", "tiny", memory="256M")
    lifecycle.start(store, "sys")
    run(store, "sys", "dd if=/dev/urandom of=/dev/vda bs=4096 seek=3000 count=8 conv=notrunc 2>/dev/null; sync")
    new_blocks = "echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/vda bs=4096 skip=3000 count=8 2>/dev/null | md5sum"
    system_digest = run(store, "sys", new_blocks)
    system = lifecycle.stop(store, "sys", force=True).version
    assert system is not None and system.ref == "sys@2"

    capsules.create(store, "box", "tiny", memory="256M", data_disks=["16M"])
    lifecycle.start(store, "box")
    run(store, "box", "echo kept | dd of=/dev/vdb conv=notrunc 2>/dev/null; sync")
    lifecycle.suspend(store, "box")
    with pytest.raises(Exception, match="box is suspended .* give --restart"):
        applying.apply(store, "box", "sys@2")
    assert [v.ref for v in store.catalogue.versions("box")] == ["box@1", "box@2"]

    res = applying.apply(store, "box", "sys@2", restart=True, stop_timeout=5)
    # resumed, stopped (nothing written since the restore: no version of its own), the new version booted
    assert res.restarted and res.before.ref == "box@2" and res.version.ref == "box@3"
    assert res.version.memory is None and res.version.chains[0] == system.chains[0]
    assert res.version.chains[1] == res.before.chains[1] and len(res.before.chains[1]) == 2
    assert store.catalogue.instance("box").version == 3
    assert run(store, "box", "head -c 4 /dev/vdb") == "kept"
    assert run(store, "box", new_blocks) == system_digest, "box runs on sys@2's system disk"
