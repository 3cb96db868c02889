"""Pods in real Debian guests, driven from the host: a counter in a pod (its own PID namespace, /tmp,
host name, address), exec into it, suspend/resume with the freezer, checkpoint → kill → restore with
the same PIDs and the count going on, and a restore into a second capsule on the same host."""

from __future__ import annotations

import time

import pytest

from capsule import capsules, lifecycle
from capsule.pod import ops
from capsule.pod.errors import PodAddressClash, PodExists, PodNotFound, PodStateConflict
from capsule.pod.relay import Relay

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1200)]

COUNTER = ["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done"]


def _in_pod(store, ref: str, script: str) -> str:
    r = ops.exec_in(store, ref, ["sh", "-c", script])
    assert r["exit_code"] == 0, r
    return r["stdout"].strip()


def _count(store, ref: str) -> int:
    return int(_in_pod(store, ref, "cat /tmp/count"))


def _pids(store, ref: str) -> list[tuple[int, str]]:
    """The pod's processes as the pod sees them (pid, command line), without the ones asking."""
    out = _in_pod(store, ref, "for p in /proc/[0-9]*; do echo ${p#/proc/} $(tr '\\0' ' ' < $p/cmdline); done")
    rows = [(int(pid), cmd.strip()) for pid, _, cmd in (ln.partition(" ") for ln in out.splitlines())]
    return sorted(r for r in rows if r[1] and "/proc/" not in r[1] and not r[1].startswith(("tr ", "sleep ")))


def _rising(store, ref: str, after: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (c := _count(store, ref)) <= after:
        assert time.monotonic() < deadline, f"{ref}: the count stays at {c}"
        time.sleep(0.5)
    return c


def test_pod_lifecycle_checkpoint_restore_and_move_to_another_capsule(debian_store):
    store = debian_store
    for name in ("pa", "pb"):
        capsules.create(store, name, "debian", memory="512M")
    lifecycle.start(store, "pa", timeout=300)

    made = ops.create(store, "pa", "ctr", COUNTER, ip="198.18.0.7/24")
    assert made["ip"] == "198.18.0.7/24" and made["state"] == "running"
    first = _rising(store, "pa/ctr", 0)

    # one PID namespace: its init is PID 1, an exec lands in it; own host name, /tmp and address
    assert _in_pod(store, "pa/ctr", "cat /proc/1/comm") == "pod-init"
    assert _in_pod(store, "pa/ctr", "hostname") == "ctr"
    assert "inet 198.18.0.7/24" in _in_pod(store, "pa/ctr", "ip -4 addr show eth0")
    pids = _pids(store, "pa/ctr")
    assert pids[0][0] == 1 and any(cmd.startswith("sh -c i=0") for _, cmd in pids), pids
    assert max(pid for pid, _ in pids) < 100, "PIDs are the pod's own, not the capsule's"
    capsule_tmp = Relay(store, "pa").sh("ls /tmp")
    assert "count" not in capsule_tmp.split(), "the pod's /tmp is private"

    # the freezer stops and continues the counter
    ops.suspend(store, "pa/ctr")
    listed = {p["name"]: p for p in ops.ls(store, "pa")}
    assert listed["ctr"]["state"] == "suspended"
    with pytest.raises(PodStateConflict, match="suspended"):
        ops.exec_in(store, "pa/ctr", ["true"])
    frozen_at = int(Relay(store, "pa").sh(f"cat /proc/{made['init_pid']}/root/tmp/count"))
    time.sleep(2)
    assert int(Relay(store, "pa").sh(f"cat /proc/{made['init_pid']}/root/tmp/count")) == frozen_at
    ops.resume(store, "pa/ctr")
    assert _rising(store, "pa/ctr", frozen_at) > frozen_at > first - 1

    # an address another pod holds is refused, and the pod holding it runs on
    with pytest.raises(PodAddressClash, match="198.18.0.7"):
        ops.create(store, "pa", "other", ["sleep", "100"], ip="198.18.0.7/24")
    # checkpoint: the pod stops once its image is sealed here
    before = _count(store, "pa/ctr")
    ck = ops.checkpoint(store, "pa/ctr")
    assert not ck.left_running and ck.size > 0
    row = store.catalogue.file(ck.image)
    assert row is not None and row.role == "pod-image" and store.file_path(ck.image).stat().st_size == ck.size
    assert [p["name"] for p in ops.ls(store, "pa")] == []
    with pytest.raises(PodNotFound):
        ops.exec_in(store, "pa/ctr", ["true"])

    # restore in the same capsule: same PIDs, the count goes on from where it was (not from 0)
    back = ops.restore(store, ck.image[:12], "pa")
    assert back["name"] == "ctr" and back["ip"] == "198.18.0.7/24" and back["state"] == "running"
    again = _count(store, "pa/ctr")
    assert again >= before, f"restored at {again}, checkpointed at ≥ {before}"
    assert _rising(store, "pa/ctr", again) > again
    assert _pids(store, "pa/ctr") == pids
    assert _in_pod(store, "pa/ctr", "hostname") == "ctr"
    with pytest.raises(PodExists):
        ops.restore(store, ck.image, "pa")

    # a checkpoint that leaves it running, restored into a second capsule on this host
    lifecycle.start(store, "pb", timeout=300)
    moving = ops.checkpoint(store, "pa/ctr", leave_running=True)
    assert moving.left_running
    assert [p["state"] for p in ops.ls(store, "pa")] == ["running"]
    there = ops.restore(store, moving.image, "pb")
    assert there["capsule"] == "pb" and there["ip"] == "198.18.0.7/24"
    c_b = _count(store, "pb/ctr")
    assert c_b >= again
    assert _rising(store, "pb/ctr", c_b) > c_b
    assert _pids(store, "pb/ctr") == pids
    assert "inet 198.18.0.7/24" in _in_pod(store, "pb/ctr", "ip -4 addr show eth0")
    # both run on, each in its own capsule
    assert _rising(store, "pa/ctr", _count(store, "pa/ctr")) > 0
    assert {p["capsule"] for p in ops.ls(store)} == {"pa", "pb"}

    for ref in ("pa/ctr", "pb/ctr"):
        assert ops.kill(store, ref)["state"] == "killed"
    assert ops.ls(store) == []
