"""Demand-paged runs between hosts that share nothing: the disk comes from the other
host's agent as the guest reads it; a prefetch frees it of the source; a source that goes
away pauses the guest, which resumes when the source is back.

The runs are asked of B's agent (POST /v1/run, as `capsule migrate --mode demand` does): its
disk servers live as long as the agent. `capsule run` from B's own CLI has a test of its own."""

from __future__ import annotations

import time

import pytest

from scripts.composehosts import wait_for

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]


def _own_layer(a, name: str, seek: int, count: int) -> str:
    """Give capsule ``name`` on A a layer no other host has (random blocks); the disk's digest."""
    a.capsule("start", name)
    a.guest(name, f"dd if=/dev/urandom of=/dev/vda bs=4096 seek={seek} count={count} conv=notrunc 2>/dev/null; sync")
    digest = a.disk_digest(name)
    a.capsule("stop", name, "--force")
    return digest


def _remote(b, name: str) -> list[dict]:
    return [x for disk in b.capsule("show", name)["disks"] for x in disk if "remote" in x]


def _run_on(b, a, name: str, prefetch: bool = False) -> dict:
    return b.api("POST", "/v1/run", {"source": a.url, "token": a.token, "ref": name, "prefetch": prefetch})


def test_demand_run_with_prefetch_then_localize(fresh):
    a, b, name = fresh
    digest = _own_layer(a, name, seek=200, count=256)

    ran = _run_on(b, a, name, prefetch=True)
    assert ran["mode"] == "boot" and ran["remote_layers"]
    assert b.disk_digest(name) == digest
    wait_for(lambda: all(x["remote"]["blocks_local"] == x["remote"]["blocks"] for x in _remote(b, name)),
             120, "the prefetch to bring every block")
    b.capsule("stop", name, "--force")
    # local now: by this `capsule localize`, or already by B's agent, whose localizer takes a complete remote
    # layer every 10 s (capsule/lifecycle/localizer.py)
    localized = b.capsule("localize")["localized"]
    assert set(localized) <= set(ran["remote_layers"])
    assert _remote(b, name) == []
    shown = b.capsule("show", name)["disks"]
    assert {x["id"] for disk in shown for x in disk if "id" in x} >= set(ran["remote_layers"]), shown

    a.stop()  # nothing on B depends on A any more
    try:
        b.capsule("start", name)
        assert b.disk_digest(name) == digest
        b.capsule("stop", name, "--force")
    finally:
        a.start()


def test_source_stopped_mid_demand_run_pauses_the_guest_until_it_returns(fresh):
    a, b, name = fresh
    _own_layer(a, name, seek=512, count=512)  # blocks 512..1023 exist only on A

    _run_on(b, a, name)
    b.guest(name, "dd if=/dev/vda of=/dev/null bs=4096 count=16 2>/dev/null")
    a.stop()
    try:
        reader = b.guest_background(name, "dd if=/dev/vda of=/dev/null bs=4096 skip=600 count=64 2>/dev/null; "
                                          "echo READ-DONE", timeout=300)
        state = wait_for(lambda: (s := b.domstate(name)).startswith("paused") and s, 120, "the guest to pause")
        assert "I/O error" in state
        time.sleep(3)
        assert b.domstate(name).startswith("paused")  # it waits: no error reached the guest
        assert reader.poll() is None
    finally:
        a.start()  # the source returns
    out, err = reader.communicate(timeout=300)
    assert "READ-DONE" in out, err
    assert b.domstate(name).startswith("running")
    assert "I/O error" not in b.guest(name, "dmesg | tail -5")
    b.capsule("stop", name, "--force")


def test_cli_run_keeps_reading_after_the_cli_exits(fresh):
    """`capsule run --from A` on B: the CLI returns, the guest keeps reading its disk from A.

    Seen failing: Debian's nbdkit (1.32) sets PR_SET_PDEATHSIG(SIGTERM) at start-up even without
    --exit-with-parent, so the disk server is told to quit when the CLI that started it exits; with
    QEMU still connected it stops serving and the guest's reads hang. Runs asked of an agent
    (the other tests here, migrate --mode demand) live as long as the agent."""
    a, b, name = fresh
    digest = _own_layer(a, name, seek=300, count=64)
    ran = b.capsule("start", name, "--from", a.url, token=a.token)
    assert ran["remote_layers"]
    # 8 MiB, most of it from A: seconds when the disk server answers
    assert b.disk_digest(name, timeout=45) == digest
    b.capsule("stop", name, "--force")
