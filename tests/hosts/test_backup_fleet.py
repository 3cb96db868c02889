"""Backups and fleet updates between hosts that share nothing but the network: a backup host that keeps
its own policy, verifies its copies and restores one; a fleet rollout that activates a new version on the
other host, and its rollback."""

from __future__ import annotations

import pytest

from scripts.demo_compose import add_peer

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(900)]

MARK_BLOCK = 300


def _mark(host, name: str, text: str) -> None:
    host.guest(name, f"echo {text} > /tmp/note; printf {text} | dd of=/dev/vda bs=4096 seek={MARK_BLOCK} "
                     "conv=notrunc 2>/dev/null; sync")


def _disk_mark(host, name: str) -> str:
    return host.guest(name, f"echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/vda bs=4096 skip={MARK_BLOCK} "
                            "count=1 2>/dev/null | head -c 9")


def _know_b(a, b) -> str:
    """Host A knows host B by its service name, as the demo's peering does (the hosts are shared by the
    session's tests); that name."""
    if b.service not in {p["name"] for p in a.capsule("host", "ls", "--offline")}:
        add_peer(a, b)
    return b.service


def _running_version(host, name: str) -> int | None:
    return next((i["version"] for i in host.capsule("tree")["instances"] if i["capsule"] == name), None)


def test_backups_copied_to_a_backup_host_that_keeps_its_own_policy(fresh):
    a, b, name = fresh
    vault = _know_b(a, b)
    a.capsule("start", name)
    a.capsule("backup", "schedule", name, "--every", "hourly", "--keep-last", "1", "--disk-only", "--to", vault,
              "--to-keep", "last=2")
    numbers = []
    for text in ("backup-01", "backup-02", "backup-03"):
        _mark(a, name, text)
        run = a.capsule("backup", "run", name)
        assert run["ok"], run
        numbers.append(run["version"])
    assert run["copy"]["pruned"] == [numbers[0]]
    here = [x["version"] for x in a.capsule("backup", "ls", name)[0]["backups"]]
    there = [int(x["ref"].split("@")[1]) for x in b.capsule("tree")["versions"] if x["ref"].startswith(f"{name}@")]
    assert here == numbers[-1:]
    assert sorted(there) == numbers[-2:]        # the backup host's copies: its own policy, the last two

    verified = a.capsule("backup", "verify")
    assert verified["ok"], verified
    assert [h["host"] for h in verified["hosts"]] == ["here", vault]
    assert verified["hosts"][1]["backups"] == [f"{name}@{n}" for n in numbers[-2:]]

    # the backup host starts a copy A no longer keeps, as it was then
    restored = b.capsule("backup", "restore", f"{name}@{numbers[1]}", "--as", f"{name}-r")
    assert restored["version"].startswith(f"{name}-r@")
    assert _disk_mark(b, f"{name}-r") == "backup-02"
    b.capsule("stop", f"{name}-r", "--force")
    a.capsule("stop", name, "--force")


def test_a_fleet_rollout_activates_the_new_version_on_the_other_host_and_rolls_back(fresh):
    a, b, name = fresh
    peer = _know_b(a, b)
    if peer not in {m["name"] for m in a.capsule("fleet", "ls")}:
        a.capsule("fleet", "add", peer, b.url, token=b.token)
    first = a.capsule("fleet", "push", f"{name}@1")
    assert first["completed"] and not first["stopped"], first
    b.capsule("start", name)
    assert _running_version(b, name) == 1

    # the administrator's update, made on A: a new version with a changed disk
    a.capsule("start", name)
    _mark(a, name, "update-v2")
    stopped = a.capsule("stop", name, "--force")
    v2 = int(stopped["version"].split("@")[1])
    rollout = a.capsule("fleet", "push", f"{name}@{v2}", "--activate")
    assert rollout["completed"] and [h["activation"] for h in rollout["hosts"]] != [None], rollout
    assert _running_version(b, name) == v2 and _disk_mark(b, name) == "update-v2"

    back = a.capsule("fleet", "rollback", f"{name}@1")
    assert back["completed"] and not back["stopped"], back
    assert _running_version(b, name) == 1 and _disk_mark(b, name) != "update-v2"
    b.capsule("stop", name, "--force")
