"""Multi-process correctness of a pod's checkpoint and restart (Laadan–Nieh): a process tree that holds a
zombie, shared memory written by one member and read by another, a pipe and a UNIX socket pair between
members with bytes in flight, a file lock, and a process asleep in a system call. The pod is checkpointed
(it dies), restored in its capsule, and each of those is checked to be exactly as it was and to go on."""

from __future__ import annotations

import json
import os
import time

import pytest

from capsule import capsules, lifecycle
from capsule.pod import ops
from capsule.pod.relay import Relay
from capsule.runtime.connection import lookup_domain

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(900)]

# The pod's program: the tree is parent → {zombie, blocked reader, counter}; it records its members' PIDs
# and then only reports, on signals, so that everything in flight at the checkpoint stays in flight.
TREE = r"""
import fcntl, json, mmap, os, signal, socket, sys, time

shared = mmap.mmap(-1, 4096)                      # MAP_SHARED | MAP_ANONYMOUS: shared with the children
zombie = os.fork()
if zombie == 0:
    os._exit(7)                                   # never reaped by its parent: a zombie

pipe_r, pipe_w = os.pipe()
os.write(pipe_w, b"bytes in the pipe\n")          # in flight: nobody reads them before the checkpoint
unix_a, unix_b = socket.socketpair()
unix_a.sendall(b"bytes in the unix socket")       # in flight too

wake_r, wake_w = os.pipe()
reader = os.fork()
if reader == 0:
    os.close(wake_w)
    got = os.read(wake_r, 100)                    # asleep in read(2) across the checkpoint
    with open("/tmp/reader-woke", "wb") as f:
        f.write(got)
    os._exit(0)
os.close(wake_r)

counter = os.fork()
if counter == 0:
    while True:                                   # a member writing the shared page
        n = int.from_bytes(shared[:8], "little") + 1
        shared[:8] = n.to_bytes(8, "little")
        time.sleep(0.1)

lock = open("/tmp/lockfile", "w")
fcntl.flock(lock, fcntl.LOCK_EX)                  # held by the parent

def drain(_sig, _frame):
    got = {"pipe": os.read(pipe_r, 100).decode(), "unix": unix_b.recv(100).decode()}
    with open("/tmp/drained.json", "w") as f:
        json.dump(got, f)

def wake(_sig, _frame):
    os.write(wake_w, b"woken after the restore")

signal.signal(signal.SIGUSR1, drain)
signal.signal(signal.SIGUSR2, wake)
with open("/tmp/tree.json", "w") as f:
    json.dump({"parent": os.getpid(), "zombie": zombie, "reader": reader, "counter": counter}, f)
while True:
    with open("/tmp/shared.tmp", "w") as f:       # the parent reads the page the counter writes
        f.write(str(int.from_bytes(shared[:8], "little")))
    os.replace("/tmp/shared.tmp", "/tmp/shared")
    time.sleep(0.2)
"""


def _sh(store, ref: str, script: str, ok: bool = True) -> tuple[int, str]:
    r = ops.exec_in(store, ref, ["sh", "-c", script])
    if ok:
        assert r["exit_code"] == 0, r
    return r["exit_code"], r["stdout"].strip()


def _state(store, ref: str, pid: int) -> str:
    """A member's state letter from /proc (R, S, Z …) as the pod sees it."""
    return _sh(store, ref, f"cut -d' ' -f3 /proc/{pid}/stat")[1]


def _wchan_read(store, ref: str, pid: int) -> str:
    return _sh(store, ref, f"cat /proc/{pid}/syscall | cut -d' ' -f1")[1]


def _shared(store, ref: str) -> int:
    return int(_sh(store, ref, "cat /tmp/shared")[1])


def _rises(store, ref: str, after: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := _shared(store, ref)) <= after:
        assert time.monotonic() < deadline, f"the shared counter stays at {n}"
        time.sleep(0.5)
    return n


def _wait_file(store, ref: str, path: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        code, out = _sh(store, ref, f"cat {path} 2>/dev/null", ok=False)
        if code == 0 and out:
            return out
        assert time.monotonic() < deadline, f"{path} never appeared in the pod"
        time.sleep(0.5)


def _snapshot(store, ref: str, tree: dict[str, int]) -> dict[str, object]:
    lock_code, _ = _sh(store, ref, "flock -n /tmp/lockfile true", ok=False)
    return {
        "zombie": _state(store, ref, tree["zombie"]),
        "reader": _state(store, ref, tree["reader"]),
        "reader_syscall": _wchan_read(store, ref, tree["reader"]),   # 0 = read(2) on x86-64
        "counter_alive": _state(store, ref, tree["counter"]) in ("R", "S"),
        "lock_taken_by_another": lock_code != 0,
        "drained": _sh(store, ref, "test -e /tmp/drained.json", ok=False)[0] == 0,
        "reader_woke": _sh(store, ref, "test -e /tmp/reader-woke", ok=False)[0] == 0,
    }


def test_a_process_tree_with_zombie_shm_pipes_sockets_locks_and_a_sleeper_survives_restart(debian_store, tmp_path):
    store = debian_store
    capsules.create(store, "ln", "debian", memory="512M")
    lifecycle.start(store, "ln", timeout=300)
    Relay(store, "ln").sh("cat > /root/tree.py", stdin=TREE)
    ops.create(store, "ln", "tree", ["python3", "/root/tree.py"], ip="198.18.0.9/24")

    tree = json.loads(_wait_file(store, "ln/tree", "/tmp/tree.json"))
    first = _rises(store, "ln/tree", 0)
    before = _snapshot(store, "ln/tree", tree)
    expected = {"zombie": "Z", "reader": "S", "reader_syscall": "0", "counter_alive": True,
                "lock_taken_by_another": True, "drained": False, "reader_woke": False}
    assert before == expected, before

    ck = ops.checkpoint(store, "ln/tree")
    assert not ck.left_running and ops.ls(store, "ln") == []
    back = ops.restore(store, ck.image, "ln")
    assert back["state"] == "running"

    # the same tree with the same PIDs, each member in the state it was in
    assert json.loads(_sh(store, "ln/tree", "cat /tmp/tree.json")[1]) == tree
    after = _snapshot(store, "ln/tree", tree)
    assert after == expected, after
    # the shared page kept its value and the counter goes on writing it; the parent still reads it
    resumed = _shared(store, "ln/tree")
    assert resumed >= first
    assert _rises(store, "ln/tree", resumed) > resumed

    # the bytes in flight in the pipe and the socket pair come out once, exactly
    _sh(store, "ln/tree", f"kill -USR1 {tree['parent']}")
    drained = json.loads(_wait_file(store, "ln/tree", "/tmp/drained.json"))
    assert drained == {"pipe": "bytes in the pipe\n", "unix": "bytes in the unix socket"}
    # the sleeper in read(2) wakes when its pipe gets data after the restore
    _sh(store, "ln/tree", f"kill -USR2 {tree['parent']}")
    assert _wait_file(store, "ln/tree", "/tmp/reader-woke") == "woken after the restore"
    # the lock is still the parent's: another process cannot take it while the parent lives
    assert _sh(store, "ln/tree", "flock -n /tmp/lockfile true", ok=False)[0] != 0
    _sh(store, "ln/tree", f"kill -TERM {tree['parent']}")
    deadline = time.monotonic() + 30
    while _sh(store, "ln/tree", "flock -n /tmp/lockfile true", ok=False)[0] != 0:
        assert time.monotonic() < deadline, "the lock was not released when its holder died"
        time.sleep(0.5)
    ops.kill(store, "ln/tree")

    # a pod image's way in and out on a lent disk (big images take it): the bytes exact both ways, and
    # the disk given back, so the capsule has its own disks only (a suspend's restore XML admits no other)
    relay = Relay(store, "ln")
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(20 << 20) + b"tail")
    assert relay.upload(blob, "/root/blob", lend=True) == 1
    back_here = tmp_path / "back"
    assert relay.download("/root/blob", blob.stat().st_size, back_here, lend=True) == 1
    assert back_here.read_bytes() == blob.read_bytes()
    domain = lookup_domain(store.catalogue.instance("ln").domain)
    assert domain is not None and domain.XMLDesc(0).count("<disk ") == 1
    lifecycle.stop(store, "ln", timeout=120)
