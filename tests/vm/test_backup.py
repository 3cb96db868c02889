"""Scheduled backups of a real tiny guest: the scheduler (injected clock) snapshots it every minute,
prune keeps the right versions and collects only what nothing else uses, and a backup restored as a
new capsule shows the guest as it was then (memory and disk)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from capsule import capsules, lifecycle, qemuimg
from capsule.backup import jobs, runner
from capsule.backup.retention import Policy
from capsule.backup.scheduler import Scheduler
from capsule.errors import Conflict
from hashcache.manifest import manifest_of_layer
from tests.helpers.guest import run

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

T0 = datetime(2026, 11, 23, 10, 0, tzinfo=UTC).timestamp()
BLOCK = 300          # a 4 KiB block of /dev/vda the test writes its marker into


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def mark(store, name: str, text: str) -> None:
    run(store, name, f"echo {text} > /tmp/note; printf {text} | dd of=/dev/vda bs=4096 seek={BLOCK} "
                     "conv=notrunc 2>/dev/null; sync")


def disk_mark(store, name: str) -> str:
    return run(store, name, f"echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/vda bs=4096 skip={BLOCK} count=1 "
                            "2>/dev/null | head -c 7")


def marks(store, name: str) -> tuple[str, str]:
    return run(store, name, "cat /tmp/note"), disk_mark(store, name)


def assert_sealed_layers_intact(store, chains) -> None:
    """Every sealed layer still hashes to its name: nothing wrote into one."""
    for chain in chains:
        for parent, lid in zip([None, *chain], chain, strict=False):
            assert manifest_of_layer(store.layer_path(lid), parent).digest == lid, f"layer {lid[:12]} changed"


def test_scheduled_backups_prune_and_restore(store):
    capsules.create(store, "desk", "tiny", memory="256M")
    lifecycle.start(store, "desk")
    clock = Clock(T0)
    jobs.schedule(store, "desk", "minutely UTC", Policy(last=2), now=T0)
    sched = Scheduler(store, clock=clock)

    for i in range(3):
        mark(store, "desk", f"state-{i}")
        clock.t = T0 + (i + 1) * 60 + 5
        assert sched.tick() == ["desk"]
        assert sched.wait_idle(300)
        job = jobs.get(store, "desk")
        assert job.last_result == "ok", job.last_error
        assert job.last_pause is not None and 0 < job.last_pause < 120
        print(f"memory backup {i}: guest paused {job.last_pause:.2f}s, {job.last_bytes} bytes new")
        assert job.next_run == T0 + (i + 2) * 60

    backups = jobs.backups(store, "desk")
    assert [v.number for v in backups] == [3, 4]          # @2 (state-0) pruned by keep-last 2
    assert store.catalogue.version("desk", 2) is None
    assert all(v.note == "backup (memory, memory)" and v.active for v in backups)
    # what only @2 used is gone; every layer the kept backups stand on is still here
    for v in backups:
        assert all(store.layer_path(lid).exists() for chain in v.chains for lid in chain)
        assert store.file_path(v.memory).exists()
    assert {f.id for f in store.catalogue.files() if f.role == "memory"} == {v.memory for v in backups}

    # the guest kept running through all of it
    assert marks(store, "desk") == ("state-2", "state-2")

    restored = runner.restore(store, "desk@3", as_name="desk-then")
    assert restored.version.ref == "desk-then@1" and restored.start.mode == "restore"
    assert marks(store, "desk-then") == ("state-1", "state-1")
    assert marks(store, "desk") == ("state-2", "state-2")

    # dry-run prune says why each is kept, and removes nothing
    result = runner.prune(store, "desk", dry_run=True)
    assert [(d.snapshot.number, d.keep, d.reasons) for d in result.decisions] == [
        (4, True, ["last"]), (3, True, ["last"])]

    # or as the new latest version of the same capsule, once it is not running
    with pytest.raises(Conflict, match="is running"):
        runner.restore(store, "desk@3")
    lifecycle.suspend(store, "desk")
    back = runner.restore(store, "desk@3")
    assert back.version.number == store.catalogue.latest_version("desk").number
    assert back.version.note == "restored from desk@3"
    assert marks(store, "desk") == ("state-1", "state-1")


def test_disk_only_backups_freeze_switch_and_boot(store):
    capsules.create(store, "d", "tiny", memory="256M")
    lifecycle.start(store, "d")
    jobs.schedule(store, "d", "daily", Policy(last=5), mode="disk-only")
    mark(store, "d", "disk-A1")

    first = runner.run(store, "d")
    assert first.ok, first.error
    v1 = store.catalogue.version("d", first.version)
    assert v1.note == "backup (disk-only, frozen)" and not v1.active
    assert first.pause < 5.0
    inst = store.catalogue.instance("d")
    assert inst.version == v1.number and inst.chains == v1.chains

    # the guest never stopped; a second backup stacks on the first
    mark(store, "d", "disk-B2")
    second = runner.run(store, "d")
    assert second.ok, second.error
    assert marks(store, "d") == ("disk-B2", "disk-B2")

    # an agent that does not answer: still a backup, recorded as crash-consistent
    run(store, "d", "kill -STOP $(pidof capsule-agent)")
    mark(store, "d", "disk-C3")
    third = runner.run(store, "d")
    run(store, "d", "kill -CONT $(pidof capsule-agent)")
    assert third.ok, third.error
    v3 = store.catalogue.version("d", third.version)
    assert v3.note == "backup (disk-only, crash-consistent)"
    # every sealed layer names its parent layer (the new leaves' headers were re-pointed), as on any host
    chain = v3.chains[0]
    for parent, lid in zip(chain, chain[1:], strict=False):
        assert qemuimg.info(store.layer_path(lid)).get("backing-filename") == f"{parent}.qcow2"
    assert_sealed_layers_intact(store, v3.chains)
    print(f"disk-only pauses: frozen {first.pause:.3f}s, {second.pause:.3f}s; unfrozen {third.pause:.3f}s")

    # the first backup boots with the disk as it was then
    runner.restore(store, f"d@{v1.number}", as_name="d-then")
    assert disk_mark(store, "d-then") == "disk-A1"

    # the running capsule's leaves were re-pointed at the sealed layers: suspend and restore keep going
    mark(store, "d", "disk-D4")
    lifecycle.suspend(store, "d")
    lifecycle.start(store, "d")
    assert marks(store, "d") == ("disk-D4", "disk-D4")
    lifecycle.stop(store, "d", timeout=2, force=True)
    runner.restore(store, f"d@{third.version}", as_name="d-crash")
    assert disk_mark(store, "d-crash") == "disk-C3"


def test_copies_to_a_backup_host_survive_it_being_down(two_hosts):
    from capsule import hosts
    from tests.conftest import Agent

    a, b, _agent_a, agent_b = two_hosts
    hosts.add(a, "vault", agent_b.url, agent_b.token)
    capsules.create(a, "desk", "tiny", memory="256M")
    lifecycle.start(a, "desk")
    jobs.schedule(a, "desk", "hourly", Policy(last=5), target="vault")

    mark(a, "desk", "copy-A1")
    first = runner.run(a, "desk")
    assert first.ok, first.error
    assert first.copy.copied == [first.version]
    assert b.catalogue.version("desk", first.version).note == "backup (memory, memory)"

    agent_b.stop()                                     # the backup host is down for one run
    mark(a, "desk", "copy-B2")
    second = runner.run(a, "desk")
    assert not second.ok and second.copy.waiting == [second.version]
    assert jobs.get(a, "desk").last_result == "not copied"
    assert a.catalogue.version("desk", second.version) is not None     # the local backup is kept

    back = Agent(b.home, agent_b.token_file, port=agent_b.port)
    try:
        third = runner.run(a, "desk")
        assert third.ok, third.error
        assert third.copy.copied == [second.version, third.version]
        # the next copies sent only what the backup host lacked: far less than the first
        assert third.copy.wire_bytes < first.copy.wire_bytes
        assert {v.number for v in b.catalogue.versions("desk")} >= {first.version, second.version, third.version}
        # the copy on the backup host starts there, as it was
        runner.restore(b, f"desk@{second.version}", as_name="desk-copy")
        assert marks(b, "desk-copy") == ("copy-B2", "copy-B2")
    finally:
        back.stop()


def test_a_disk_only_backup_that_fails_to_seal_leaves_the_guest_as_it_was(store, monkeypatch):
    from capsule.errors import StorageFull

    capsules.create(store, "d", "tiny", memory="256M")
    lifecycle.start(store, "d")
    jobs.schedule(store, "d", "daily", Policy(last=5), mode="disk-only")
    mark(store, "d", "keep-E5")
    before = store.catalogue.instance("d")
    versions = len(store.catalogue.versions("d"))

    def full(*_args, **_kwargs):
        raise StorageFull("sealing layer: the store's file system is full")

    monkeypatch.setattr(store, "seal_layer", full)
    result = runner.run(store, "d")
    assert not result.ok and "file system is full" in result.error
    assert jobs.get(store, "d").last_result == "failed"
    assert len(store.catalogue.versions("d")) == versions                 # no half-made version
    assert store.catalogue.instance("d").leaves == before.leaves          # committed back into the old leaf
    monkeypatch.undo()
    assert_sealed_layers_intact(store, before.chains)                    # the commit stopped at the leaf

    # the guest went on writing, and nothing of it is lost: suspend, start, read
    mark(store, "d", "keep-F6")
    lifecycle.suspend(store, "d")
    lifecycle.start(store, "d")
    assert marks(store, "d") == ("keep-F6", "keep-F6")
    again = runner.run(store, "d")
    assert again.ok, again.error


def test_the_agent_runs_a_missed_backup_once_at_start(store, tmp_path):
    from tests.conftest import Agent
    from tests.wait import wait_until

    capsules.create(store, "desk", "tiny", memory="256M")
    lifecycle.start(store, "desk")
    jobs.schedule(store, "desk", "minutely", Policy(last=3))
    # as if the agent had been down for an hour: the slots missed meanwhile are one run, at start
    store.catalogue.query("UPDATE backup_jobs SET next_run=? WHERE capsule='desk'", (time.time() - 3600,))
    agent = Agent(store.home, tmp_path / "agent.token")
    try:
        job = wait_until(lambda: (j := jobs.get(store, "desk")).last_result and j, 180,
                         "the agent's scheduler to run the missed backup")
        assert job.last_result == "ok", job.last_error
        assert job.next_run > time.time() - 5
        assert len(jobs.backups(store, "desk")) == 1
    finally:
        agent.stop()
