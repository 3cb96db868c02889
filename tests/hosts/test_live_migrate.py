"""Live moves between the compose hosts (`capsule migrate NAME --to HOST`, live by default): the guest keeps
running while its disks (sealed at T0, pushed with HCP) and its memory travel, and pauses only at the
switchover. Every stream between the hosts crosses in the agents' tunnel (no libvirtd or QEMU port of its own)."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from scripts.composehosts import ComposeError, wait_for
from testkit import guestclock  # (the offsets: Host.guest_offset, sampled in the host)

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(900)]

# a counter and the guest's clock (centiseconds of uptime) every 100 ms, in tmpfs: the guest's own record of
# how long it did not run
COUNTER = ("mkdir -p /dev/shm && (i=0; while :; do i=$((i+1)); read up _ < /proc/uptime; "
           "echo \"$i $up\" >> /dev/shm/counter; sleep 0.1; done) >/dev/null 2>&1 &")
DIRTIER = ("(while :; do dd if=/dev/urandom of=/dev/shm/dirty bs=1M count=48 2>/dev/null; done) "
           ">/dev/null 2>&1 &")


def _counter(host, name: str) -> list[tuple[int, float]]:
    out = host.guest(name, "cat /dev/shm/counter")
    rows = [line.split() for line in out.splitlines() if len(line.split()) == 2]
    return [(int(i), float(up)) for i, up in rows if i.isdigit()]


def _files_there(host, name: str) -> str:
    return host.sh(f'ls "$CAPSULE_HOME/instances/{name}" 2>/dev/null; '
                   f'for f in "$CAPSULE_HOME"/layers/leaf-*.qcow2; do [ -e "$f" ] && echo "$f"; done; true')


def _note(host, ref: str) -> str:
    return host.capsule("show", ref).get("note", "")


def test_a_live_move_keeps_the_guest_running_with_a_short_pause(fresh):
    a, b, name = fresh
    a.capsule("start", name)
    a.guest(name, "echo written-before > /root/before; sync")
    a.guest(name, COUNTER)
    time.sleep(2)
    before = a.guest_offset(name)
    t0 = time.monotonic()
    moved = a.capsule("migrate", name, "--to", b.url, token=b.token, timeout=600)
    seconds = time.monotonic() - t0
    after = b.guest_offset(name)
    paused, error = guestclock.paused(before, after)
    assert moved["mode"] == "live" and moved["progress"]["outcome"] == "done"
    phases = [e["phase"] for e in moved["events"] if e["phase"]]
    assert phases[0] == "precheck" and phases[-1] == "switchover"
    assert dict.fromkeys(phases) == dict.fromkeys(["precheck", "disks", "memory", "switchover"])
    live = moved["live"]
    assert moved["remote"]["running"] and live["pause_ms"] is not None and not live["postcopy"]
    # every stream crossed in the tunnel, memory through the codec: fewer bytes than QEMU wrote, and pages of
    # the guest's page cache sent as references to blocks of T0's layers, which the other host holds
    assert 0 < live["memory_wire_bytes"] <= live["tunnel_bytes"]
    assert live["memory_wire_bytes"] < live["memory_bytes"]
    assert live["memory_refs"] > 0 and live["memory_raw_pages"] > 0

    time.sleep(1)
    rows = _counter(b, name)
    assert all(y[0] == x[0] + 1 for x, y in zip(rows, rows[1:], strict=False)), "the counter jumped"
    assert all(y[1] >= x[1] for x, y in zip(rows, rows[1:], strict=False)), "the guest's clock went back"
    print(f"\nlive move of a tiny guest: {seconds:.1f} s; paused {paused * 1000:.0f} ± {error * 1000:.0f} ms by the "
          f"guest's clock against the host's, libvirt downtime {live['pause_ms']} ms; {live['rounds']} rounds, "
          f"memory {live['memory_bytes']} B ({live['memory_wire_bytes']} B on the link, {live['memory_refs']} pages "
          f"as references), disks since T0 {live['disk_bytes']} B; tunnel {live['tunnel_bytes']} B; "
          f"HCP wire {moved['push']['wire_bytes']} B")
    assert paused < 5.0, f"the guest was paused {paused:.1f} s"     # a sanity bound, not a speed target
    assert b.guest(name, "cat /root/before") == "written-before"
    assert b.state(name) == "running" and a.states()[name]["domain"] is None
    t0_ref = moved["version"]
    assert _note(a, t0_ref) == _note(b, t0_ref) == "live move: disks at T0"
    b.capsule("stop", name, "--force")


def _prepared_there(b, name: str) -> str:
    return b.sh(f'ls "$CAPSULE_HOME/instances" 2>/dev/null | grep -x {name} || true').strip()


def test_a_live_move_cancelled_during_pre_copy_leaves_the_guest_here(fresh):
    a, b, name = fresh
    a.capsule("start", name)
    a.guest(name, COUNTER)
    a.guest(name, DIRTIER)
    time.sleep(2)
    before = _counter(a, name)[-1][0]
    proc = a.capsule_background("migrate", name, "--to", b.url, "--max-pause", "0.01", token=b.token)
    try:
        # pre-copy under way: the other host has prepared the instance
        wait_for(lambda: _prepared_there(b, name), 300, "the other host to prepare the move")
        time.sleep(2)
        pid = a.sh(f"pgrep -f 'capsule --json migrate {name} ' | head -1").strip()
        assert pid.isdigit()
        a.sh(f"kill -INT {pid}")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out
    error = json.loads(out) if out.strip().startswith("{") else {}
    assert error.get("error") == "migration_cancelled" or "cancelled" in (out + err), out + err
    assert a.state(name) == "running" and a.states()[name]["domain"]
    wait_for(lambda: _counter(a, name)[-1][0] > before + 20, 60, "the counter to go on here")
    assert name not in b.states() or b.states()[name]["domain"] is None
    assert _files_there(b, name) == ""
    a.capsule("stop", name, "--force")


def test_a_link_cut_during_pre_copy_fails_the_move_and_the_guest_runs_on_here(fresh):
    a, b, name = fresh
    a.capsule("start", name)
    a.guest(name, COUNTER)
    a.guest(name, DIRTIER)
    time.sleep(2)
    before = _counter(a, name)[-1][0]
    proc = a.capsule_background("migrate", name, "--to", b.url, "--max-pause", "0.01", token=b.token)
    killed = False
    try:
        dom = a.domain(name)
        wait_for(lambda: "Unbounded" in a.sh(f"virsh -c qemu:///system domjobinfo {dom}"), 300,
                 "libvirt's job to send memory")       # pre-copy under way (it cannot converge: the dirtier)
        assert _prepared_there(b, name)
        time.sleep(1)
        agent = b.sh("pgrep -f '[c]apsule --home .* serve' | head -1").strip()
        assert agent.isdigit()
        killed = True
        with contextlib.suppress(ComposeError):        # (its container stops with it, maybe under this exec)
            b.sh(f"kill -KILL {agent}")                 # the destination's agent, and with it the tunnel, goes
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        if killed:
            wait_for(lambda: not b.running(), 60, "the destination's container to stop with its agent")
            b.start()                                   # its agent starts again: the unfinished move is removed
    said = " ".join(err.split())
    print(f"\nthe link cut during pre-copy: {said}")
    assert proc.returncode != 0, out
    assert f"the live move of {name} failed" in said and "the link to the other host broke" in said, said
    assert f"{name} runs on here" in said, said
    assert a.state(name) == "running" and a.states()[name]["domain"]
    wait_for(lambda: _counter(a, name)[-1][0] > before + 20, 60, "the counter to go on here")
    assert name not in b.states() or b.states()[name]["domain"] is None
    assert _files_there(b, name) == ""
    assert b.sh("virsh -c qemu:///system list --all --name").split() == []
    a.capsule("stop", name, "--force")


def test_a_capsule_that_does_not_run_is_refused_by_the_check(fresh):
    a, b, name = fresh
    failed = a.capsule_fails("--json", "migrate", name, "--to", b.url, "--check", token=b.token)
    body = json.loads(failed.stdout)
    assert [r["reason"] for r in body["refusals"]] == ["not_running"]
    assert f"capsule start {name}" in body["refusals"][0]["detail"]
    assert failed.returncode == 5
