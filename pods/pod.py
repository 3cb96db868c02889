"""Pods in this guest: create (namespaces, cgroup, veth on the bridge), exec (Zap's add-process),
list, freeze/thaw (cgroup v2 freezer), kill. State: one JSON file per pod under /run/pods."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pods import nft, sysops
from pods.names import (
    BRIDGE,
    UPLINK_MAC_PREFIX,
    PodError,
    allocate,
    check_free,
    check_name,
    gateway,
    host_veth,
    parse_ip,
)

STATE = Path("/run/pods")
CGROUP = Path("/sys/fs/cgroup/pods")
PY = "/usr/bin/python3"


def sh(argv: list[str], what: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise PodError(f"{what}: {' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}", "pod_failed")
    return r.stdout


def state_path(name: str) -> Path:
    return STATE / f"{check_name(name)}.json"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cgroup_of(name: str) -> Path:
    return CGROUP / name


def frozen(name: str) -> bool:
    try:
        return "frozen 1" in (cgroup_of(name) / "cgroup.events").read_text()
    except OSError:
        return False


def load(name: str) -> dict[str, Any]:
    try:
        rec = json.loads(state_path(name).read_text())
    except FileNotFoundError:
        raise PodError(f"no pod {name!r} in this capsule", "not_found") from None
    return rec


def describe(rec: dict[str, Any]) -> dict[str, Any]:
    pid = rec["init_pid"]
    state = "exited" if not alive(pid) else ("suspended" if frozen(rec["name"]) else "running")
    procs = []
    with contextlib.suppress(OSError):
        procs = [int(p) for p in (cgroup_of(rec["name"]) / "cgroup.procs").read_text().split()]
    return {**rec, "state": state, "processes": len(procs)}


def all_pods() -> list[dict[str, Any]]:
    if not STATE.is_dir():
        return []
    return [describe(json.loads(p.read_text())) for p in sorted(STATE.glob("*.json"))]


def taken_addresses(except_name: str | None = None) -> dict[str, ipaddress.IPv4Interface]:
    return {p["name"]: ipaddress.IPv4Interface(p["ip"]) for p in all_pods()
            if p["state"] != "exited" and p["name"] != except_name}


def ensure_bridge(net: ipaddress.IPv4Network) -> None:
    if not Path(f"/sys/class/net/{BRIDGE}").exists():
        sh(["ip", "link", "add", BRIDGE, "type", "bridge"], "make the pod bridge")
    gw = f"{gateway(net)}/{net.prefixlen}"
    if gw not in sh(["ip", "-o", "-4", "addr", "show", "dev", BRIDGE], "read the bridge"):
        sh(["ip", "addr", "add", gw, "dev", BRIDGE], "address the pod bridge")
    sh(["ip", "link", "set", BRIDGE, "up"], "bring the pod bridge up")
    if (link := uplink()) is not None:
        join_uplink(link, net)


def uplink() -> str | None:
    """The capsule's NIC on the host's pod bridge, when it has one (its MAC has UPLINK_MAC_PREFIX)."""
    for dev in sorted(Path("/sys/class/net").iterdir()):
        with contextlib.suppress(OSError):
            if (dev / "address").read_text().strip().startswith(UPLINK_MAC_PREFIX):
                return dev.name
    return None


def join_uplink(link: str, net: ipaddress.IPv4Network) -> None:
    """pods0 enslaves the uplink (no address of its own), so the pods share the host's segment; the
    gateway address stays each capsule's own (``nft.guard_gateway``)."""
    if Path(f"/sys/class/net/{link}/master").resolve().name != BRIDGE:
        sh(["ip", "addr", "flush", "dev", link], "clear the uplink's addresses")
        with contextlib.suppress(OSError):
            Path(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6").write_text("1")
        sh(["ip", "link", "set", link, "master", BRIDGE, "up"], "attach the uplink to the pod bridge")
    try:
        nft.guard_gateway(link, str(gateway(net)))
    except OSError as exc:
        raise PodError(f"could not guard the gateway address on the uplink {link}: {exc}", "pod_failed") from None


def in_netns(init_pid: int, work: Callable[[], Any], what: str, then: Callable[[], Any] | None = None) -> Any:
    """``work()`` run in the network namespace of the pod whose init is ``init_pid``, in a forked child
    (this process keeps its own namespace): its JSON-able result, or its failure as a PodError. A fork
    instead of ``nsenter … python3 -m …``: no second interpreter to start (~0.1–0.3 s each under TCG).
    ``then()``, if given, runs in the child after it has answered, detached from this command's output
    (its failure is nobody's: nothing waits for it)."""
    ns = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        code = 0
        try:
            os.close(r)
            sysops.setns(ns, sysops.CLONE_NEWNET)
            out = {"ok": work()}
        except BaseException as exc:  # the child reports every failure, then exits
            out, code, then = {"error": f"{type(exc).__name__}: {exc}"}, 1, None
        try:
            os.write(w, json.dumps(out).encode())
            os.close(w)
            if then is not None:  # let go of the agent's pipes: the command's reply does not wait for this
                null = os.open("/dev/null", os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                then()
        finally:
            os._exit(code)
    os.close(w)
    os.close(ns)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    if then is None:
        os.waitpid(child, 0)
    try:
        out = json.loads(raw)
    except ValueError:
        out = {"error": "it died before it said anything"}
    if "error" in out:
        raise PodError(f"{what}: {out['error']}", "pod_failed")
    return out["ok"]


def unlock_and_announce(init_pid: int, ip: str) -> list[str]:
    """After a restore, in one child in the pod's network namespace: remove the lock tables the
    checkpoint left (:func:`pods.nft.unlock`) and announce the pod's address (a gratuitous ARP: the
    bridges and the peers learn where it is now); the tables removed. The announcement's repeats
    (:func:`pods.announce.announce`) go out after this returns."""
    from pods import announce as arp  # socket, fcntl: only a restore needs them

    address = ip.split("/")[0]

    def work() -> list[str]:
        tables = nft.unlock()
        arp.announce("eth0", address, count=1)
        return tables

    def repeat() -> None:
        time.sleep(arp.INTERVAL)
        arp.announce("eth0", address, count=arp.COUNT - 1)

    return list(in_netns(init_pid, work, "unlock and announce the pod's network", then=repeat))


def choose_address(ip: str | None, name: str) -> ipaddress.IPv4Interface:
    taken = taken_addresses(name)
    if ip is None:
        return allocate({a.ip for a in taken.values()})
    iface = parse_ip(ip)
    check_free(iface, taken)
    return iface


def _refuse_existing(name: str) -> None:
    try:
        rec = load(name)
    except PodError:
        return
    if alive(rec["init_pid"]):
        raise PodError(f"pod {name!r} already runs in this capsule", "already_exists")
    forget(name)


def make_cgroup(name: str) -> Path:
    CGROUP.mkdir(exist_ok=True)
    cg = cgroup_of(name)
    cg.mkdir(exist_ok=True)
    return cg


def create(name: str, cmd: list[str], ip: str | None = None) -> dict[str, Any]:
    check_name(name)
    if not cmd:
        raise PodError("a pod needs a command to run", "invalid_name")
    _refuse_existing(name)
    iface = choose_address(ip, name)
    ensure_bridge(iface.network)
    cg = make_cgroup(name)
    pid_r, pid_w = os.pipe()
    go_r, go_w = os.pipe()
    launcher = os.fork()
    if launcher == 0:  # joins the cgroup, unshares, forks the pod's init, says its pid, exits
        try:
            os.close(pid_r)
            os.close(go_w)
            os.setsid()
            (cg / "cgroup.procs").write_text(str(os.getpid()))
            sysops.unshare(sysops.POD_NAMESPACES)
            init = os.fork()
            if init == 0:
                os.close(pid_w)
                os.set_inheritable(go_r, True)
                null = os.open("/dev/null", os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.execv(PY, [PY, "-m", "pods.init", str(go_r), name, *cmd])
            os.write(pid_w, str(init).encode())
        finally:
            os._exit(0)
    os.close(pid_w)
    os.close(go_r)
    os.waitpid(launcher, 0)
    with os.fdopen(pid_r, "rb") as f:
        raw = f.read()
    if not raw:
        os.close(go_w)
        raise PodError(f"could not start pod {name!r} (unshare refused?)", "pod_failed")
    init_pid = int(raw)
    veth = host_veth(name)
    try:
        plumb(init_pid, veth, iface)
    except PodError:
        os.close(go_w)
        kill_cgroup(name)
        raise
    rec = {"name": name, "ip": str(iface), "veth": veth, "init_pid": init_pid, "cmd": cmd,
           "created": time.time()}
    save(rec)
    os.write(go_w, b"go")
    os.close(go_w)
    return describe(rec)


def plumb(init_pid: int, veth: str, iface: ipaddress.IPv4Interface) -> None:
    """The pod's eth0 in its network namespace, its peer on the bridge."""
    if Path(f"/sys/class/net/{veth}").exists():
        sh(["ip", "link", "del", veth], "remove a stale veth")
    sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(init_pid)],
       "make the pod's veth pair")
    sh(["ip", "link", "set", veth, "master", BRIDGE, "up"], "attach the veth to the bridge")
    inside = ["nsenter", "-t", str(init_pid), "-n"]
    sh([*inside, "ip", "link", "set", "lo", "up"], "bring the pod's lo up")
    sh([*inside, "ip", "addr", "add", str(iface), "dev", "eth0"], "address the pod")
    sh([*inside, "ip", "link", "set", "eth0", "up"], "bring the pod's eth0 up")
    sh([*inside, "ip", "route", "add", "default", "via", str(gateway(iface.network))], "route the pod")


def save(rec: dict[str, Any]) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    tmp = state_path(rec["name"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, state_path(rec["name"]))


def unplug(name: str) -> None:
    """Delete the pod's veth pair (its eth0 goes with the host end)."""
    veth = host_veth(name)
    if Path(f"/sys/class/net/{veth}").exists():
        subprocess.run(["ip", "link", "del", veth], capture_output=True)


def forget(name: str) -> None:
    state_path(name).unlink(missing_ok=True)
    unplug(name)
    with contextlib.suppress(OSError):
        cgroup_of(name).rmdir()


def running(name: str) -> dict[str, Any]:
    rec = load(name)
    if not alive(rec["init_pid"]):
        raise PodError(f"pod {name!r} has exited (its init is gone); `pod kill` removes it", "conflict")
    return rec


def exec_in(name: str, cmd: list[str], timeout: float) -> dict[str, Any]:
    """Run a command in every namespace and the cgroup of the pod (Zap's add-process)."""
    rec = running(name)
    if frozen(name):
        raise PodError(f"pod {name!r} is suspended; resume it first", "conflict")
    cg = cgroup_of(name) / "cgroup.procs"

    def join() -> None:
        cg.write_text(str(os.getpid()))

    argv = ["nsenter", "-t", str(rec["init_pid"]), "-p", "-m", "-u", "-i", "-n", "-r", "-w", "--", "setsid", "-w", *cmd]
    try:
        r = subprocess.run(argv, capture_output=True, timeout=timeout, preexec_fn=join)
    except subprocess.TimeoutExpired:
        raise PodError(f"{cmd[0]} in pod {name!r} did not finish in {timeout:.0f} s", "guest_timeout") from None
    return {"exit_code": r.returncode, "stdout": r.stdout.decode(errors="replace"),
            "stderr": r.stderr.decode(errors="replace")}


def set_frozen(name: str, freeze: bool, timeout: float = 10.0) -> dict[str, Any]:
    rec = running(name)
    cg = cgroup_of(name)
    (cg / "cgroup.freeze").write_text("1" if freeze else "0")
    deadline = time.monotonic() + timeout
    while frozen(name) != freeze:
        if time.monotonic() > deadline:
            raise PodError(f"pod {name!r} did not {'freeze' if freeze else 'thaw'} in {timeout:.0f} s",
                           "guest_timeout")
        time.sleep(0.02)
    return describe(rec)


def kill_cgroup(name: str, timeout: float = 10.0) -> None:
    cg = cgroup_of(name)
    if not cg.is_dir():
        return
    (cg / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + timeout
    while (cg / "cgroup.procs").read_text().strip():
        if time.monotonic() > deadline:
            raise PodError(f"the processes of pod {name!r} did not die in {timeout:.0f} s", "guest_timeout")
        time.sleep(0.02)


def kill(name: str) -> dict[str, Any]:
    rec = load(name)
    kill_cgroup(name)
    forget(name)
    return {**rec, "state": "killed"}


if __name__ == "__main__":
    print(json.dumps(all_pods()), file=sys.stdout)
