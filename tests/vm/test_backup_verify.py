"""Backup verify jobs on a real tiny guest with a backup host: everything the backups reference is
re-hashed here and, through its agent, on the backup host; a broken object is named with the backups
that use it; a backup host that is down is reported, not skipped; the scheduler runs the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from capsule import capsules, hosts, lifecycle
from capsule.backup import jobs, runner, verifyjob
from capsule.backup.retention import Policy
from capsule.backup.scheduler import VERIFY, Scheduler
from tests.conftest import Agent

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


def corrupt(path) -> None:
    """Flip the first byte that holds data (root ignores the object's read-only mode)."""
    with open(path, "r+b") as f:
        offset = 0
        while block := f.read(1 << 20):
            if block.strip(b"\0"):
                i = len(block) - len(block.lstrip(b"\0"))
                f.seek(offset + i)
                f.write(bytes([block[i] ^ 0xFF]))
                return
            offset += len(block)
    raise AssertionError(f"{path} holds no data")


def cli(store, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CAPSULE_HOME=str(store.home))
    return subprocess.run([sys.executable, "-m", "capsule.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_verify_here_and_on_the_backup_host(two_hosts):
    a, b, _agent_a, agent_b = two_hosts
    hosts.add(a, "vault", agent_b.url, agent_b.token)
    capsules.create(a, "desk", "tiny", memory="256M")
    lifecycle.start(a, "desk")
    jobs.schedule(a, "desk", "hourly", Policy(last=5), target="vault")
    first, second = runner.run(a, "desk"), runner.run(a, "desk")
    assert first.ok and second.ok, (first.error, second.error)
    refs = [f"desk@{first.version}", f"desk@{second.version}"]

    good = verifyjob.run(a)
    assert good.ok, good.summary()
    assert [h.host for h in good.hosts] == ["here", "vault"]
    assert good.hosts[0].backups == refs and good.hosts[1].backups == refs
    assert good.hosts[1].checked_files >= 2 and good.hosts[1].checked_layers >= 1

    # a memory image broken on the backup host only: named there, with the backup that uses it
    memory = b.catalogue.version("desk", first.version).memory
    corrupt(b.file_path(memory))
    broken = verifyjob.run(a)
    assert not broken.ok and broken.first_broken is not None
    assert (broken.first_broken.host, broken.first_broken.id) == ("vault", memory)
    assert broken.first_broken.backups == [refs[0]]
    assert not broken.hosts[0].broken                     # here it is intact
    r = cli(a, "--json", "backup", "verify")
    assert r.returncode == 6, r.stderr
    assert json.loads(r.stdout)["first_broken"]["id"] == memory
    assert cli(a, "backup", "verify", "--here-only").returncode == 0

    # the backup host down: reported as not checked (exit 1), the local check still done
    agent_b.stop()
    down = verifyjob.run(a)
    assert down.hosts[0].checked_files >= 2 and not down.hosts[0].broken
    assert down.hosts[1].error and not down.ok and down.first_broken is None
    r = cli(a, "backup", "verify")
    assert r.returncode == 1 and "vault not checked" in r.stdout
    back = Agent(b.home, agent_b.token_file, port=agent_b.port)
    try:
        # the scheduler runs the verify job at its slot and records what it found
        clock = [0.0]
        jobs.unschedule(a, "desk")          # (its backups stay, and so does what to verify)
        job = verifyjob.schedule(a, "hourly")
        scheduler = Scheduler(a, clock=lambda: clock[0])
        clock[0] = job.next_run - 1
        assert VERIFY not in scheduler.tick()
        clock[0] = job.next_run + 1
        assert scheduler.tick() == [VERIFY]
        assert scheduler.wait_idle(300)
        assert scheduler.tick() == []                       # once per slot
        done = verifyjob.get(a)
        assert done.last_result == "broken" and memory[:16] in done.last_error
        assert done.next_run > clock[0]
    finally:
        back.stop()


def test_the_backup_host_keeps_its_own_longer_policy(two_hosts):
    a, b, _agent_a, agent_b = two_hosts
    hosts.add(a, "vault", agent_b.url, agent_b.token)
    capsules.create(a, "desk", "tiny", memory="256M")
    lifecycle.start(a, "desk")
    jobs.schedule(a, "desk", "hourly", Policy(last=1), mode="disk-only", target="vault",
                  target_policy=Policy(last=3))
    runs = [runner.run(a, "desk") for _ in range(5)]
    assert all(r.ok for r in runs), [r.error for r in runs]
    numbers = [r.version for r in runs]
    assert [v.number for v in jobs.backups(a, "desk")] == numbers[-1:]            # here: the last one
    assert [v.number for v in jobs.backups(b, "desk")] == numbers[-3:]            # there: the last three
    assert runs[-1].copy.copied == [numbers[-1]] and runs[-1].copy.pruned == [numbers[-4]]
    # pruned copies are not sent again, and verify asks the backup host only for what it still holds
    again = runner.run(a, "desk")
    assert again.copy.copied == [again.version]
    check = verifyjob.run(a)
    assert check.ok, check.summary()
    assert check.hosts[1].backups == [f"desk@{n}" for n in [*numbers[-2:], again.version]]
    # the backup host's copies of pruned versions were collected there: what remains still verifies
    r = cli(b, "--json", "verify")
    assert r.returncode == 0, r.stdout + r.stderr
