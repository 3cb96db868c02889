"""Hosts that go away: a version still starts on B after A's container is removed
entirely; a push to a host stopped midway fails cleanly and resumes once it is back."""

from __future__ import annotations

import pytest

from scripts.composehosts import wait_for

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(900)]


def test_version_starts_on_b_after_a_is_removed(fresh):
    a, b, name = fresh
    a.capsule("start", name)
    a.guest(name, "echo moved-in-memory > /tmp/mark")
    a.capsule("suspend", name)
    a.capsule("push", name, "--to", b.url, token=b.token)

    a.remove()  # A's root file system, libvirtd and agent are gone; only its store volume is kept
    try:
        assert not a.running()
        started = b.capsule("start", name)
        assert started["mode"] == "restore"
        assert b.guest(name, "cat /tmp/mark") == "moved-in-memory"
        b.capsule("stop", name, "--force")
    finally:
        a.start()
    assert a.state(name) == "suspended"  # a new container on the same volume has A's store back


def _received_kib(b) -> int:
    return int(b.sh('mkdir -p "$CAPSULE_HOME/recv"; du -sk "$CAPSULE_HOME/recv" | cut -f1'))


def test_push_to_a_host_stopped_midway_fails_cleanly_then_resumes(fresh):
    a, b, name = fresh
    a.capsule("start", name)
    # 48 MiB of random blocks: a layer that takes a while to push with one small request in flight
    a.guest(name, "dd if=/dev/urandom of=/dev/vda bs=4096 seek=1024 count=12288 conv=notrunc 2>/dev/null; sync",
            timeout=240)
    digest = a.disk_digest(name, blocks=13312)
    a.capsule("stop", name, "--force")

    push = a.capsule_background("push", name, "--to", b.url, "--inflight", "1", "--batch", "4", token=b.token)
    try:
        wait_for(lambda: _received_kib(b) > 4096 or push.poll() is not None, 180, "B to receive 4 MiB")
        assert push.poll() is None, "the push ended before B was stopped"
        b.stop()
        out, err = push.communicate(timeout=180)
    finally:
        if push.poll() is None:
            push.kill()
        b.start()
    assert push.returncode != 0, out
    assert "error:" in err and "Traceback" not in err, err
    assert b.state(name) is None  # nothing half-installed: B has no version of it

    again = a.capsule("push", name, "--to", b.url, token=b.token)
    # what arrived before is not sent again (the layer is random data: no other host has its blocks;
    # a push reports blocks the receiver already holds, from any source, as cache_bytes)
    layer = max((o for o in again["objects"] if o["kind"] == "layer"), key=lambda o: o["raw_bytes"])
    assert layer["raw_bytes"] >= 48 * 1024 * 1024
    assert layer["raw_bytes"] - layer["fetched_bytes"] >= 4096 * 1024, layer
    b.capsule("start", name)
    assert b.disk_digest(name, blocks=13312) == digest
    b.capsule("stop", name, "--force")
