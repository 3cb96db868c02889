"""The pod network between the capsules of a host: two Debian capsules made with ``--pod-network`` join the
host's pod bridge; a TCP client in a network namespace this test makes (attached to that bridge, an
address of 198.18.0.0/24) talks to a server in a pod of the first capsule, numbered line after numbered
line, while ``capsule pod migrate`` moves the pod to the second capsule. The connection goes on: no reset,
every line answered exactly once and in order, the pod's address, MAC and PIDs the same over there. Then
the clash rules (an address held elsewhere on the pod network is refused, the pod holding it runs on) and a
suspend and resume of the capsule now holding the pod, with the connection still going."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capsule import lifecycle
from capsule.pod import ops
from capsule.pod.errors import PodAddressClash
from capsule.pod.relay import Relay
from capsule.runtime import podnet
from tests.vm.podkit import NUMBERING_CLIENT, NUMBERING_SERVER

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(2400)]

SERVER = NUMBERING_SERVER
# the client, in the test's namespace: line i must come back as "i i"; one log line per round trip
CLIENT = NUMBERING_CLIENT
CLIENT_ADDRESS = "198.18.0.250/24"


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


@pytest.fixture
def client_ns():
    """A network namespace of this test on the host's pod bridge: eth0 with CLIENT_ADDRESS."""
    podnet.ensure_bridge()
    ns, veth = f"capsule-podnet-{os.getpid()}", f"cpn{os.getpid() % 100000}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", podnet.BRIDGE, "up")
        for argv in (("link", "set", "lo", "up"), ("addr", "add", CLIENT_ADDRESS, "dev", "eth0"),
                     ("link", "set", "eth0", "up")):
            _ip("netns", "exec", ns, "ip", *argv)
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _log(path: Path) -> list[tuple[int, float]]:
    lines = path.read_text().splitlines() if path.exists() else []
    bad = [ln for ln in lines if not ln[:1].isdigit()]
    assert not bad, f"the TCP client saw: {bad}"
    return [(int(a), float(b)) for a, b in (ln.split() for ln in lines)]


def _beyond(path: Path, client: subprocess.Popen, n: int, timeout: float = 180.0) -> list[tuple[int, float]]:
    deadline = time.monotonic() + timeout
    while not (log := _log(path)) or log[-1][0] <= n:
        assert client.poll() is None or log, f"the client ended: {client.stderr.read() if client.stderr else ''}"
        assert time.monotonic() < deadline, f"the TCP client is stuck at {log[-1:]}"
        time.sleep(0.5)
    return log


def _in_pod(store, ref: str, script: str) -> str:
    r = ops.exec_in(store, ref, ["sh", "-c", script])
    assert r["exit_code"] == 0, r
    return r["stdout"].strip()


def _pids(store, ref: str) -> list[tuple[int, str]]:
    out = _in_pod(store, ref, "for p in /proc/[0-9]*; do echo ${p#/proc/} $(tr '\\0' ' ' < $p/cmdline); done")
    rows = [(int(pid), cmd.strip()) for pid, _, cmd in (ln.partition(" ") for ln in out.splitlines())]
    return sorted(r for r in rows if r[1] and "/proc/" not in r[1] and not r[1].startswith("tr "))


def _gap(log: list[tuple[int, float]], after: int) -> float:
    """The longest wait between two replies from round trip ``after`` on."""
    times = [t for i, t in log if i >= after]
    return max(b - a for a, b in zip(times, times[1:], strict=False))


def test_a_tcp_connection_survives_pod_migrate_between_two_capsules(pod_network_pair, client_ns, tmp_path):
    store = pod_network_pair.store   # na and nb: running, no pods (tests/vm/podpair.py)
    for name in ("na", "nb"):
        inst = store.catalogue.instance(name)
        assert inst is not None and store.catalogue.version(name, inst.version).config["pod_network"] is True
    Relay(store, "na").sh("cat > /root/pod-server.py", stdin=SERVER)

    # addresses are unique on the whole pod network: the second capsule's first pod does not get .2 again
    srv = ops.create(store, "na", "srv", ["python3", "/root/pod-server.py"])
    assert srv["ip"] == "198.18.0.2/24"
    other = ops.create(store, "nb", "other", ["sleep", "100000"])
    assert other["ip"] == "198.18.0.3/24"
    with pytest.raises(PodAddressClash, match="held by pod na/srv"):
        ops.create(store, "nb", "dup", ["sleep", "100"], ip="198.18.0.2/24")
    mac = _in_pod(store, "na/srv", "cat /sys/class/net/eth0/address")
    pids = _pids(store, "na/srv")

    log_path, stop = tmp_path / "client.log", tmp_path / "stop"
    client = subprocess.Popen(["ip", "netns", "exec", client_ns, sys.executable, "-c", CLIENT, "198.18.0.2",
                               str(log_path), str(stop)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        talked = _beyond(log_path, client, 10)[-1][0]

        moved = ops.migrate(store, "na/srv", "nb")
        assert moved["to"] == "nb" and moved["state"] == "running" and moved["ip"] == "198.18.0.2/24"
        assert ops.ls(store, "na") == []
        log = _beyond(log_path, client, _log(log_path)[-1][0] + 10)  # talking again after the move
        assert [i for i, _ in log] == list(range(1, len(log) + 1)), "a line lost, doubled or out of order"
        gap = _gap(log, talked)
        print(f"pod migrate na → nb under a TCP client on the pod network: longest gap between replies "
              f"{gap:.2f} s; migrate {moved['seconds']:.2f} s (checkpoint {moved['checkpoint_seconds']:.2f} s, "
              f"restore {moved['restore_seconds']:.2f} s, image {moved['size']} bytes)")
        assert _in_pod(store, "nb/srv", "cat /sys/class/net/eth0/address") == mac
        assert "inet 198.18.0.2/24" in _in_pod(store, "nb/srv", "ip -4 addr show eth0")
        assert _pids(store, "nb/srv") == pids

        # a restore onto an address another capsule's pod holds is refused; the holder runs on, untouched
        init_pid = {p["name"]: p for p in ops.ls(store, "nb")}["srv"]["init_pid"]
        copy = ops.checkpoint(store, "nb/srv", leave_running=True)
        with pytest.raises(PodAddressClash, match="held by pod nb/srv"):
            ops.restore(store, copy.image, "na")
        assert ops.ls(store, "na") == []
        assert {p["name"]: p for p in ops.ls(store, "nb")}["srv"]["init_pid"] == init_pid
        n = _beyond(log_path, client, _log(log_path)[-1][0] + 5)[-1][0]

        # the capsule holding the pod suspended and resumed (its pod uplink restored): the client goes on
        lifecycle.suspend(store, "nb")
        lifecycle.start(store, "nb")
        log = _beyond(log_path, client, _log(log_path)[-1][0] + 10, timeout=300)
        assert [i for i, _ in log] == list(range(1, len(log) + 1))
        print(f"capsule suspend + resume of nb: longest gap {_gap(log, n):.2f} s; {len(log)} round trips "
              f"on one connection")
        assert [p["state"] for p in ops.ls(store, "nb") if p["name"] == "srv"] == ["running"]
    finally:
        stop.touch()
        try:
            client.wait(timeout=30)
        except subprocess.TimeoutExpired:
            client.kill()
            client.wait()
    assert client.returncode == 0, client.stderr.read() if client.stderr else ""
