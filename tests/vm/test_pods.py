"""Pods in real Debian guests, driven from the host: a counter in a pod (its own PID namespace, /tmp,
host name, address), exec into it, suspend/resume with the freezer, checkpoint → kill → restore with
the same PIDs and the count going on (a TCP peer's connection too), a restore into a second capsule on
the same host, and a migration there."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from capsule import capsules, lifecycle
from capsule.errors import Conflict
from capsule.pod import ops
from capsule.pod.errors import PodAddressClash, PodExists, PodLayerMissing, PodNotFound, PodStateConflict
from capsule.pod.relay import LEND_FROM_IN, Relay
from tests.helpers.guest import COUNT_LOOP
from tests.vm.podkit import NUMBERING_CLIENT, NUMBERING_SERVER

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1200)]

# the pod: a TCP server (each line numbered back) and a counter in /tmp
SERVER = NUMBERING_SERVER
POD_CMD = ["sh", "-c", "python3 /root/pod-server.py & " + COUNT_LOOP]
# the peer, outside the pod in the capsule: one connection, line i must come back as "i i"
CLIENT = NUMBERING_CLIENT


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


def _peer_log(store, capsule: str) -> list[tuple[int, float]]:
    lines = Relay(store, capsule).sh("cat /root/peer.log 2>/dev/null || true").splitlines()
    bad = [ln for ln in lines if not ln[:1].isdigit()]
    assert not bad, f"the TCP peer saw: {bad}"
    return [(int(a), float(b)) for a, b in (ln.split() for ln in lines)]


def _peer_beyond(store, capsule: str, n: int, timeout: float = 60.0) -> list[tuple[int, float]]:
    deadline = time.monotonic() + timeout
    while not (log := _peer_log(store, capsule)) or log[-1][0] <= n:
        assert time.monotonic() < deadline, f"the TCP peer is stuck at {log[-1:]}"
        time.sleep(0.5)
    return log


def _install(store, capsule: str) -> None:
    for name, text in (("pod-server.py", SERVER), ("peer.py", CLIENT)):
        Relay(store, capsule).sh(f"cat > /root/{name}", stdin=text)


@pytest.fixture
def peer(pod_pair) -> Iterator[list[str]]:
    """The TCP peer's PIDs in capsule pa (it starts them); stopped at the end, its log removed."""
    pids: list[str] = []
    Relay(pod_pair.store, "pa").sh("rm -f /root/peer.log")
    yield pids
    Relay(pod_pair.store, "pa").sh(f"kill {' '.join(pids)} 2>/dev/null; rm -f /root/peer.log; true")


def test_pod_lifecycle_checkpoint_restore_and_move_to_another_capsule(pod_pair, peer):
    store = pod_pair.store   # pa and pb: running, no pods (tests/vm/podpair.py)
    _install(store, "pa")

    made = ops.create(store, "pa", "ctr", POD_CMD, ip="198.18.0.7/24")
    assert made["ip"] == "198.18.0.7/24" and made["state"] == "running"
    first = _rising(store, "pa/ctr", 0)

    # one PID namespace: its init is PID 1, an exec lands in it; own host name, /tmp and address
    assert _in_pod(store, "pa/ctr", "cat /proc/1/comm") == "pod-init"
    assert _in_pod(store, "pa/ctr", "hostname") == "ctr"
    assert "inet 198.18.0.7/24" in _in_pod(store, "pa/ctr", "ip -4 addr show eth0")
    pids = _pids(store, "pa/ctr")
    assert pids[0][0] == 1 and any(cmd.startswith("sh -c python3 /root/pod-server.py") for _, cmd in pids), pids
    assert any(c == "python3 /root/pod-server.py" for _, c in pids), pids
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
    # a TCP peer in the capsule, outside the pod, talks to it over the pod bridge
    peer.append(Relay(store, "pa").sh(
        "setsid python3 /root/peer.py 198.18.0.7 /root/peer.log </dev/null >/dev/null 2>&1 & echo $!").strip())
    talked = _peer_beyond(store, "pa", 5)[-1][0]

    # checkpoint: the pod stops at the dump, its image sealed here
    before = _count(store, "pa/ctr")
    ck = ops.checkpoint(store, "pa/ctr")
    assert not ck.left_running and ck.size > 0
    assert ck.copy_route == "direct"   # packed straight onto a lent disk: no archive file in the guest
    assert Relay(store, "pa").sh("ls -A /var/lib/pods/out /var/lib/pods/dump 2>/dev/null | grep -v :$ || true"
                                 ).strip() == ""   # nor a dump left behind
    row = store.catalogue.file(ck.image)
    assert row is not None and row.role == "pod-image" and store.file_path(ck.image).stat().st_size == ck.size
    assert [p["name"] for p in ops.ls(store, "pa")] == []
    with pytest.raises(PodNotFound):
        ops.exec_in(store, "pa/ctr", ["true"])

    # restore in the same capsule: same PIDs, the count goes on from where it was (not from 0)
    back = ops.restore(store, ck.image[:12], "pa")
    assert back["copy_route"] == ("direct" if ck.size >= LEND_FROM_IN else "file")
    assert back["name"] == "ctr" and back["ip"] == "198.18.0.7/24" and back["state"] == "running"
    again = _count(store, "pa/ctr")
    assert again >= before, f"restored at {again}, checkpointed at ≥ {before}"
    assert _rising(store, "pa/ctr", again) > again
    assert _pids(store, "pa/ctr") == pids
    assert _in_pod(store, "pa/ctr", "hostname") == "ctr"
    # the peer's connection lived through it: no reset, every line answered once, in order
    log = _peer_beyond(store, "pa", talked + 5)
    assert [i for i, _ in log] == list(range(1, len(log) + 1))
    gap = max(b - a for (_, a), (_, b) in zip(log, log[1:], strict=False))
    print(f"TCP peer: {len(log)} round trips on one connection, longest gap {gap:.2f} s across "
          f"checkpoint {ck.seconds:.2f} s + restore {back['seconds']:.2f} s (image {ck.size} bytes)")
    with pytest.raises(PodExists):
        ops.restore(store, ck.image, "pa")

    # a checkpoint that leaves it running, restored into a second capsule on this host
    # pb as it booted, before any pod call: the pod layer was compiled when the image was built, not at its first call
    compiled = pod_pair.compiled["pb"]
    assert {"ckpt.cpython-311.pyc", "podimage.cpython-311.pyc", "__main__.cpython-311.pyc"} <= set(compiled)
    _install(store, "pb")
    moving = ops.checkpoint(store, "pa/ctr", leave_running=True)
    assert moving.left_running
    assert [p["state"] for p in ops.ls(store, "pa")] == ["running"]
    # pb has a pod on that address: the restore is refused there, and nothing of it is left in pb
    ops.create(store, "pb", "blocker", ["sleep", "1000"], ip="198.18.0.7/24")
    with pytest.raises(PodAddressClash, match="taken by pod 'blocker'"):
        ops.restore(store, moving.image, "pb")
    assert [p["name"] for p in ops.ls(store, "pb")] == ["blocker"]
    ops.kill(store, "pb/blocker")
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

    # migrate: refused up front while the name runs there, the pod untouched (not even restarted)
    init_pa = {p["name"]: p for p in ops.ls(store, "pa")}["ctr"]["init_pid"]
    with pytest.raises(PodExists, match="stays where it is"):
        ops.migrate(store, "pa/ctr", "pb")
    assert {p["name"]: p for p in ops.ls(store, "pa")}["ctr"]["init_pid"] == init_pa
    # then moved: gone from pa, running in pb with its PIDs and its count going on
    assert ops.kill(store, "pb/ctr")["state"] == "killed"
    last = _count(store, "pa/ctr")
    moved = ops.migrate(store, "pa/ctr", "pb")
    assert moved["to"] == "pb" and moved["state"] == "running" and moved["ip"] == "198.18.0.7/24"
    assert ops.ls(store, "pa") == []
    assert _count(store, "pb/ctr") >= last
    assert _pids(store, "pb/ctr") == pids
    print(f"pod migrate pa → pb: {moved['seconds']:.2f} s (checkpoint {moved['checkpoint_seconds']:.2f} s, "
          f"restore {moved['restore_seconds']:.2f} s, image {moved['size']} bytes)")

    assert ops.kill(store, "pb/ctr")["state"] == "killed"
    assert ops.ls(store) == []


def test_a_capsule_without_the_pod_layer_says_so(store):
    capsules.create(store, "tc", "tiny")
    lifecycle.start(store, "tc", timeout=120)
    with pytest.raises(PodLayerMissing, match="capsule 'tc' has no pod layer"):
        ops.create(store, "tc", "web", ["sleep", "100"])
    with pytest.raises(PodLayerMissing):
        ops.ls(store, "tc")
    assert ops.ls(store) == []  # listing every capsule passes over the ones without pods
    capsules.create(store, "idle", "tiny")
    with pytest.raises(Conflict, match="'idle' is not running"):
        ops.exec_in(store, "idle/web", ["true"])
