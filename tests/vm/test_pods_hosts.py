"""`capsule pod migrate --host`: a pod moves from a capsule of host A to a capsule of host B (two stores,
B's agent on loopback): same PIDs, its count goes on, gone from A; its image travelled with HCP. A transfer
killed in the middle (B's agent stops while the image is on its way) leaves the pod running on A."""

from __future__ import annotations

import threading
import time

import pytest

from capsule import capsules, lifecycle
from capsule.errors import Unreachable
from capsule.pod import ops, remote
from capsule.pod.errors import PodAddressClash
from tests.conftest import Agent, _destroy_domains, make_store

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1500)]

POD = ["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done"]


def _count(store, ref: str) -> int:
    r = ops.exec_in(store, ref, ["cat", "/tmp/count"])
    assert r["exit_code"] == 0, r
    return int(r["stdout"])


def _pids(store, ref: str) -> list[str]:
    """The pod's init and its counting shell (not the short-lived `sleep`s, nor this asking shell: its own
    text never holds the words it looks for)."""
    script = ("for p in /proc/[0-9]*; do case \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" in "
              "*whil[e]\\ true*) echo ${p#/proc/};; esac; done; echo 1")
    r = ops.exec_in(store, ref, ["sh", "-c", script])
    assert r["exit_code"] == 0, r
    return sorted(r["stdout"].split(), key=int)


def _rising(store, ref: str, after: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while (c := _count(store, ref)) <= after:
        assert time.monotonic() < deadline, f"{ref}: the count stays at {c}"
        time.sleep(0.5)
    return c


@pytest.fixture
def hosts(tmp_path, debian_images):
    a = make_store(tmp_path / "a", debian_images, "debian")
    b = make_store(tmp_path / "b", debian_images, "debian")
    agent_b = Agent(b.home, tmp_path / "b.token")
    yield a, b, agent_b
    agent_b.stop()
    for s in (a, b):
        _destroy_domains(s)
        s.close()


def test_a_pod_moves_to_a_capsule_on_another_host_and_a_killed_transfer_leaves_it_home(hosts, tmp_path):
    a, b, agent_b = hosts
    capsules.create(a, "ca", "debian", memory="512M")
    capsules.create(b, "cb", "debian", memory="512M")
    lifecycle.start(a, "ca", timeout=300)
    lifecycle.start(b, "cb", timeout=300)
    ops.create(a, "ca", "ctr", POD, ip="198.18.0.21/24")
    first = _rising(a, "ca/ctr", 0)
    pids = _pids(a, "ca/ctr")

    # the address is taken on B: refused before anything stops, the pod untouched on A
    ops.create(b, "cb", "blocker", ["sleep", "1000"], ip="198.18.0.21/24")
    init_a = ops.ls(a, "ca")[0]["init_pid"]
    with pytest.raises(PodAddressClash, match="stays where it is"):
        remote.migrate(a, "ca/ctr", "cb", agent_b.url, agent_b.token)
    assert ops.ls(a, "ca")[0]["init_pid"] == init_a
    ops.kill(b, "cb/blocker")

    # B's agent dies while the image is on its way: the pod runs again on A, with its count going on
    def kill_when(phase: str) -> None:
        if phase == "sending the image":
            threading.Thread(target=agent_b.stop, daemon=True).start()
            time.sleep(1.0)  # the push meets a dead agent

    before = _count(a, "ca/ctr")
    with pytest.raises(Unreachable):
        remote.migrate(a, "ca/ctr", "cb", agent_b.url, agent_b.token, progress=kill_when)
    assert [p["name"] for p in ops.ls(a, "ca")] == ["ctr"]
    assert _rising(a, "ca/ctr", before) > before >= first
    assert _pids(a, "ca/ctr") == pids
    assert ops.ls(b, "cb") == []

    # B's agent back: the move goes through; B may hold part of the image already (HCP)
    agent_b2 = Agent(b.home, tmp_path / "b.token")
    try:
        last = _count(a, "ca/ctr")
        moved = remote.migrate(a, "ca/ctr", "cb", agent_b2.url, agent_b2.token)
        assert moved["to"] == "cb" and moved["state"] == "running" and moved["ip"] == "198.18.0.21/24"
        assert 0 < moved["wire_bytes"] <= moved["size"] * 1.05 + 65536
        assert ops.ls(a, "ca") == []
        assert _count(b, "cb/ctr") >= last
        assert _rising(b, "cb/ctr", _count(b, "cb/ctr")) > last
        assert _pids(b, "cb/ctr") == pids
        assert b.catalogue.file(moved["image"]).role == "pod-image"
        print(f"pod migrate to another host: {moved['seconds']:.2f} s (checkpoint {moved['checkpoint_seconds']:.2f}"
              f" s, send {moved['send_seconds']:.2f} s, restore {moved['restore_seconds']:.2f} s), image "
              f"{moved['size']} bytes, {moved['wire_bytes']} on the wire")
    finally:
        agent_b2.stop()
