"""Moving capsules between hosts that share nothing but the network: push, pull, migrate."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]

MARK = "echo moved-in-memory > /tmp/mark"


def test_pull_then_boot_on_the_other_host_reads_the_same_disk(fresh):
    a, b, name = fresh
    a.capsule("start", name)
    a.guest(name, "dd if=/dev/urandom of=/dev/vda bs=4096 seek=100 count=64 conv=notrunc 2>/dev/null; sync")
    digest = a.disk_digest(name)
    stopped = a.capsule("stop", name, "--force")
    assert stopped["layers"], "the guest's writes should be a new layer"

    pulled = b.capsule("pull", name, "--from", a.url, token=a.token)
    assert pulled["version"] == stopped["version"]
    started = b.capsule("start", name)
    assert started["mode"] == "boot"
    assert b.disk_digest(name) == digest
    b.capsule("stop", name, "--force")


def test_push_then_start_on_the_other_host_restores_memory(fresh):
    a, b, name = fresh
    a.capsule("start", name)
    a.guest(name, MARK)
    suspended = a.capsule("suspend", name)
    assert suspended["memory"]

    a.capsule("push", name, "--to", b.url, token=b.token)
    started = b.capsule("start", name)
    assert started["mode"] == "restore"
    assert b.guest(name, "cat /tmp/mark") == "moved-in-memory"
    b.capsule("stop", name, "--force")


@pytest.mark.parametrize("mode", ["full", "demand"])
def test_migrate_a_running_capsule(fresh, mode):
    a, b, name = fresh
    a.capsule("start", name)
    a.guest(name, MARK)
    extra = ["--source-url", a.url] if mode == "demand" else []
    moved = a.capsule("migrate", name, "--to", b.url, "--mode", mode, *extra, token=b.token)
    assert moved["mode"] == mode
    assert a.state(name) != "running"
    assert b.state(name) == "running"
    assert b.guest(name, "cat /tmp/mark") == "moved-in-memory"
    b.capsule("stop", name, "--force")
