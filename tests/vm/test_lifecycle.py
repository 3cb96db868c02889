"""Real tiny guests under libvirt: suspend/resume continuity, snapshots,
and a second capsule started from a snapshot."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from capsule.runtime.connection import lookup_domain
from tests.helpers.guest import COUNTER, count, run, uptime, wait_count_above

pytestmark = pytest.mark.vm


def test_counter_continues_across_suspend_and_start(store):
    capsules.create(store, "c1", "tiny", memory="256M")
    booted = lifecycle.start(store, "c1")
    assert booted.mode == "boot"
    run(store, "c1", COUNTER)
    before = wait_count_above(store, "c1", 10)
    up_before = uptime(store, "c1")

    sealed = lifecycle.suspend(store, "c1")
    assert sealed.version is not None and sealed.version.active
    assert lookup_domain(store.domain_name("c1")) is None
    # the sparse memory image holds far less than the guest's 256 MiB
    assert sealed.memory is not None and sealed.memory.allocated < 200 << 20

    resumed = lifecycle.start(store, "c1")
    assert resumed.mode == "restore" and not resumed.forked_memory
    after = count(store, "c1")
    # no reboot: the count and the uptime continue from where they stopped
    assert before <= after < before + 25
    assert uptime(store, "c1") >= up_before
    assert wait_count_above(store, "c1", after) > after


def test_snapshot_keeps_running_and_starts_as_second_capsule(store):
    capsules.create(store, "src", "tiny", memory="256M")
    lifecycle.start(store, "src")
    run(store, "src", COUNTER)
    run(store, "src", "echo from-before-snapshot > /tmp/note")
    at_snapshot = wait_count_above(store, "src", 5)

    sealed, resumed = lifecycle.snapshot(store, "src")
    snap = sealed.version
    assert snap is not None and snap.active
    assert resumed.mode == "restore"
    # the original keeps running on a new leaf
    assert wait_count_above(store, "src", at_snapshot + 10) > at_snapshot + 10
    inst = store.catalogue.instance("src")
    assert inst is not None and inst.version == snap.number

    # the snapshot, started as a second capsule beside the first
    capsules.derive(store, snap.ref, "copy")
    second = lifecycle.start(store, "copy")
    assert second.forked_memory  # another domain name and uuid than the saved one
    assert run(store, "copy", "cat /tmp/note") == "from-before-snapshot"
    c_copy = count(store, "copy")
    assert at_snapshot <= c_copy < at_snapshot + 40
    run(store, "copy", "echo only-in-copy > /tmp/note")
    assert run(store, "src", "cat /tmp/note") == "from-before-snapshot"
    assert lookup_domain(store.domain_name("src")) is not None
    assert lookup_domain(store.domain_name("copy")) is not None


def test_stop_records_disk_changes_and_boots_them(store):
    from tests.helpers.guest import disk_digest, write_blocks

    capsules.create(store, "d", "tiny", memory="256M")
    lifecycle.start(store, "d")
    write_blocks(store, "d", seek=50, count=8)
    digest = disk_digest(store, "d")
    result = lifecycle.stop(store, "d", timeout=2)
    assert result.version is not None and not result.version.active
    assert result.layers and result.layers[0].blocks == 8
    lifecycle.start(store, "d")
    assert disk_digest(store, "d") == digest


def test_stop_without_writes_records_no_version(store):
    capsules.create(store, "idle", "tiny", memory="256M")
    lifecycle.start(store, "idle")
    result = lifecycle.stop(store, "idle", force=True)
    assert result.version is None
    assert [v.number for v in store.catalogue.versions("idle")] == [1]
    assert store.catalogue.instance("idle") is None
    assert not list(store.layers_dir.glob("leaf-*"))
