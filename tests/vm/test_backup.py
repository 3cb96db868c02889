"""Scheduled backups of a real tiny guest: the scheduler (injected clock) snapshots it every minute,
prune keeps the right versions and collects only what nothing else uses, and a backup restored as a
new capsule shows the guest as it was then (memory and disk)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from capsule import capsules, lifecycle
from capsule.backup import jobs, runner
from capsule.backup.retention import Policy
from capsule.backup.scheduler import Scheduler
from capsule.errors import Conflict
from tests.vm.helpers import run

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


def marks(store, name: str) -> tuple[str, str]:
    disk = run(store, name, f"echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/vda bs=4096 skip={BLOCK} count=1 "
                            "2>/dev/null | head -c 7")
    return run(store, name, "cat /tmp/note"), disk


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
