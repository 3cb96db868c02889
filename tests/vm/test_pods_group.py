"""A coordinated checkpoint (ZapC): two pods in two capsules on the host's pod network pass a counter back and
forth over TCP without pause; the pair
is checkpointed as one group (networks locked first, then both dumped) and restarted together. The counter
goes on with no gap and no repeat on either side. A bad group (one pod named twice, a pod that is not
there) is refused with everything running on."""

from __future__ import annotations

import time

import pytest

from capsule import hierarchy
from capsule.pod import group, ops
from capsule.pod.errors import PodNameInvalid, PodNotFound
from capsule.pod.relay import Relay

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1200)]

# n arrives, n + 1 goes back; each side logs what it receives (the server the even numbers, the client the odd)
SERVER = r"""
import socket
s = socket.socket()
s.bind(("0.0.0.0", 7100))
s.listen()
c, _ = s.accept()
f = c.makefile("rb")
log = open("/tmp/got", "a", buffering=1)
for line in f:
    n = int(line)
    log.write(f"{n}\n")
    c.sendall(b"%d\n" % (n + 1))
"""
CLIENT = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], 7100), timeout=600)
f = s.makefile("rb")
log = open("/tmp/got", "a", buffering=1)
n = 0
while True:
    s.sendall(b"%d\n" % n)
    m = int(f.readline())
    assert m == n + 1, (n, m)
    log.write(f"{m}\n")
    n = m + 1
    time.sleep(0.05)
"""


def _got(store, ref: str) -> list[int]:
    r = ops.exec_in(store, ref, ["cat", "/tmp/got"])
    assert r["exit_code"] == 0, r
    return [int(x) for x in r["stdout"].split()]


def _beyond(store, ref: str, n: int, timeout: float = 120.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while not (got := _got(store, ref)) or got[-1] <= n:
        assert time.monotonic() < deadline, f"{ref}: the counter stays at {got[-1:]}"
        time.sleep(0.5)
    return got


def test_two_pods_in_two_capsules_talking_over_tcp_checkpoint_and_restart_as_one_group(pod_network_pair):
    # two capsules on this host's pod network, running, no pods (tests/vm/podpair.py): their pods share one segment
    store = pod_network_pair.store
    Relay(store, "na").sh("cat > /root/server.py", stdin=SERVER)
    Relay(store, "nb").sh("cat > /root/client.py", stdin=CLIENT)
    ops.create(store, "na", "ping", ["python3", "/root/server.py"], ip="198.18.0.41/24")
    time.sleep(1.0)
    ops.create(store, "nb", "pong", ["python3", "/root/client.py", "198.18.0.41"], ip="198.18.0.42/24")
    before = _beyond(store, "nb/pong", 20)[-1]

    # refused, nothing stops
    with pytest.raises(PodNameInvalid, match="twice"):
        group.checkpoint_group(store, ["na/ping", "na/ping"])
    with pytest.raises(PodNotFound):
        group.checkpoint_group(store, ["na/ping", "na/nosuch"])
    assert _beyond(store, "nb/pong", before)[-1] > before

    made = group.checkpoint_group(store, ["na/ping", "nb/pong"])
    assert {(m["capsule"], m["pod"]) for m in made["members"]} == {("na", "ping"), ("nb", "pong")}
    assert ops.ls(store, "na") == [] and ops.ls(store, "nb") == []
    hierarchy.gc(store, max_pending_age=0)
    assert store.file_path(made["group"]).exists(), "gc keeps group images"

    back = group.restore_group(store, made["group"][:10])
    assert {(m["pod"], m["state"]) for m in back["members"]} == {("ping", "running"), ("pong", "running")}
    odd = _beyond(store, "nb/pong", _got(store, "nb/pong")[-1] + 20)
    even = _got(store, "na/ping")
    # no gap, no repeat, on either side, across the checkpoint and the restart
    assert odd == list(range(1, 2 * len(odd), 2)), odd[-30:]
    assert even == list(range(0, 2 * len(even), 2)), even[-30:]
    print(f"group checkpoint {made['seconds']:.2f} s (lock {made['lock_seconds']:.2f} s), restart "
          f"{back['seconds']:.2f} s; the counter went on to {odd[-1]}")
    with pytest.raises(PodNotFound, match="no pod 'other'"):
        group.restore_group(store, made["group"], {"other": "na"})
    ops.kill(store, "na/ping")
    ops.kill(store, "nb/pong")
