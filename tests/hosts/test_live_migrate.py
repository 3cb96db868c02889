"""Live moves between the compose hosts (`capsule migrate NAME --to HOST`, live by default): the guest keeps
running while its disks (sealed at T0, pushed with HCP) and its memory travel, and pauses only at the
switchover. Libvirt's and QEMU's connections go through the agents' byte tunnel. The pause is measured as the
guest lived it: its own clock stops while it is paused, so it is the growth of host time − guest uptime across
the move (testkit/guestclock.py), not a gap between the guest's own stamps."""

from __future__ import annotations

import json
import time

import pytest

from scripts.composehosts import wait_for
from testkit.guestclock import offset, paused

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
    before = offset(lambda cmd: a.guest(name, cmd))
    t0 = time.monotonic()
    moved = a.capsule("migrate", name, "--to", b.url, token=b.token, timeout=600)
    seconds = time.monotonic() - t0
    pause, error = paused(before, offset(lambda cmd: b.guest(name, cmd)))
    assert moved["mode"] == "live" and moved["progress"]["outcome"] == "done"
    phases = [e["phase"] for e in moved["events"] if e["phase"]]
    assert phases[0] == "precheck" and phases[-1] == "switchover"
    assert dict.fromkeys(phases) == dict.fromkeys(["precheck", "disks", "memory", "switchover"])
    assert moved["remote"]["running"] and moved["live"]["pause_ms"] is not None

    time.sleep(1)
    rows = _counter(b, name)
    gaps = [(y[1] - x[1]) for x, y in zip(rows, rows[1:], strict=False)]
    assert all(y[0] == x[0] + 1 for x, y in zip(rows, rows[1:], strict=False)), "the counter jumped"
    assert all(g >= 0 for g in gaps), "the guest's clock went back"
    print(f"\nlive move of a tiny guest: {seconds:.1f} s; paused {pause * 1000:.0f} ± {error * 1000:.0f} ms as the "
          f"guest lived it, libvirt downtime {moved['live']['pause_ms']} ms; memory {moved['live']['memory_bytes']} B; "
          f"HCP wire {moved['push']['wire_bytes']} B; through the tunnel {moved['live']['tunnel_bytes']} B")
    # a sanity bound, not a speed target (those are bench/livemigrate.py's): an offline move pauses it for the
    # whole transfer, ~15 s here
    assert pause < 5.0, f"paused {pause:.2f} s"
    assert moved["live"]["tunnel_bytes"] > moved["live"]["memory_bytes"] * 0.5   # the stream went through it
    assert b.guest(name, "cat /root/before") == "written-before"
    assert b.state(name) == "running" and a.states()[name]["domain"] is None
    t0_ref = moved["version"]
    assert _note(a, t0_ref) == _note(b, t0_ref) == "live move: disks at T0"
    b.capsule("stop", name, "--force")


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
        wait_for(lambda: b.sh(f'ls "$CAPSULE_HOME/instances" 2>/dev/null | grep -x {name} || true').strip(),
                 300, "the other host to prepare the move")
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


def test_a_capsule_that_does_not_run_is_refused_by_the_check(fresh):
    a, b, name = fresh
    failed = a.capsule_fails("--json", "migrate", name, "--to", b.url, "--check", token=b.token)
    body = json.loads(failed.stdout)
    assert [r["reason"] for r in body["refusals"]] == ["not_running"]
    assert f"capsule start {name}" in body["refusals"][0]["detail"]
    assert failed.returncode == 5
