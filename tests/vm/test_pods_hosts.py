"""`capsule pod migrate --on`: a pod moves from a capsule of host A to a capsule of host B (two stores,
B's agent on loopback): same PIDs, its count goes on, gone from A; its image travelled with HCP. A transfer
killed in the middle (B's agent stops while the image is on its way) leaves the pod running on A. Moved back
to A, whose store holds its first image, far fewer bytes travel: the image's pages are 4 KiB-aligned and
dedup. A kernel CRIU refuses gives a typed error up front and the pod runs on."""

from __future__ import annotations

import json
import threading
import time

import pytest

from capsule import capsules, lifecycle
from capsule.errors import Unreachable
from capsule.pod import ops, remote
from capsule.pod.errors import CriuUnsupported, PodAddressClash
from capsule.pod.relay import Relay
from testkit.images import destroy_domains, make_store
from tests.conftest import Agent
from tests.helpers.guest import COUNT_LOOP

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1500)]

HELD = 8 << 20  # random bytes a process of the pod holds: the image's pages, incompressible
POD = ["sh", "-c", f"python3 -c 'import os, time; b = os.urandom({HELD}); time.sleep(1e9)' & " + COUNT_LOOP]
# a stand-in for a kernel CRIU refuses (none boots here): `criu check` fails as CRIU does on one
FAKE_CRIU = """#!/bin/sh
echo "Error (criu/cr-check.c:1462): Kernel doesn't support PTRACE_O_SUSPEND_SECCOMP" >&2
echo "Error (criu/cr-check.c:1690): CRIU needs features the kernel lacks" >&2
exit 1
"""


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
        destroy_domains(s)
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

        # and back to A, whose store holds the pod's first image: its held pages are found there
        agent_a = Agent(a.home, tmp_path / "a.token")
        try:
            back = remote.migrate(b, "cb/ctr", "ca", agent_a.url, agent_a.token)
        finally:
            agent_a.stop()
        assert back["state"] == "running" and ops.ls(b, "cb") == [] and _pids(a, "ca/ctr") == pids
        assert back["size"] > HELD and back["found_there_bytes"] >= HELD * 0.9, back
        assert back["wire_bytes"] < HELD / 4, back
        print(f"moved back to A: {back['wire_bytes']} bytes on the wire for an image of {back['size']} "
              f"({back['found_there_bytes']} found there)")
    finally:
        agent_b2.stop()
    _criu_refused_up_front(a)


def _criu_refused_up_front(a) -> None:
    """A fake ``criu`` first on PATH for one call stands in for a kernel CRIU refuses (the cached success of
    this boot removed first): the checkpoint stops at ``criu check`` with its reason, exit 3 and kind
    ``criu_unsupported`` in the guest, CriuUnsupported (exit code 9) on the host; the pod is not touched."""
    relay = Relay(a, "ca")
    relay.sh("mkdir -p /root/fake-criu && cat > /root/fake-criu/criu && chmod +x /root/fake-criu/criu",
             stdin=FAKE_CRIU)
    init = ops.ls(a, "ca")[0]["init_pid"]
    path = "PATH=/root/fake-criu:/usr/sbin:/usr/bin:/sbin:/bin"
    raw = relay.sh(f"rm -f /run/pods/criu-ok; env {path} python3 -m pods checkpoint ctr; echo exit=$?")
    lines = raw.strip().splitlines()
    assert lines[-1] == "exit=3", raw
    reply = json.loads(lines[-2])
    assert reply["ok"] is False and reply["kind"] == "criu_unsupported", reply
    assert "PTRACE_O_SUSPEND_SECCOMP" in reply["error"]
    with pytest.raises(CriuUnsupported, match="criu check says: .*PTRACE_O_SUSPEND_SECCOMP.*keep running") as e:
        relay.call("checkpoint", "ctr", env={"PATH": path.split("=", 1)[1]})
    assert e.value.exit_code == 9 and e.value.code == "pod_criu_unsupported"
    assert ops.ls(a, "ca")[0]["init_pid"] == init
    assert _rising(a, "ca/ctr", _count(a, "ca/ctr")) > 0
    # the real criu passes its check again: a checkpoint that leaves the pod running works
    assert ops.checkpoint(a, "ca/ctr", leave_running=True).left_running
