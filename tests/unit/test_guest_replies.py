"""What a guest answers is bounded by what the host asked: a pod checkpoint's size by the capsule's RAM
(``capsule.pod.replies.image_cap``), its path by where the pod layer writes that pod's images, a copy's chunks
by the bytes asked for; and a reply of the wrong shape is the typed guest-agent error, through the agent's HTTP
API too — never a ValueError, TypeError or KeyError. A real store, a fake guest agent on the capsule's socket."""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from capsule import capsules
from capsule.agent.app import create_app
from capsule.lifecycle import balloon
from capsule.pod import ops, replies
from capsule.pod.errors import PodFailed
from capsule.pod.relay import LEND_FROM_OUT, Relay
from capsule.runtime.guestagent import AgentReplyInvalid, Reply, exec_result
from capsule.runtime.hotdisk import HotDiskUnavailable
from capsule.store import Store
from capsule.store.catalogue import InstanceRow
from tests.helpers.fakeagent import ExecAgent, requests
from tests.unit.test_dashboard_api import TOKEN, _fake_image

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GOOD_PATH = "/var/lib/pods/out/web-20250101T120000-42.pod"
CAP = replies.image_cap(256)   # the capsule below has 256 MiB of RAM


def pods_says(result: Any, ok: Any = True) -> dict[str, Any]:
    """An exec result whose stdout is the pod layer's JSON line."""
    return {"exit_code": 0, "stdout": json.dumps({"ok": ok, "result": result}) + "\n", "stderr": "", "timed_out": False}


def done(stdout: str = "") -> dict[str, Any]:
    return {"exit_code": 0, "stdout": stdout, "stderr": "", "timed_out": False}


def checkpoint_result(**over: Any) -> dict[str, Any]:
    return {"name": "web", "path": GOOD_PATH, "size": 1000, "dump_seconds": 0.5, "seconds": 0.7,
            "left_running": False, "ip": "10.77.0.5/24"} | over


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "store")
    _fake_image(s)
    capsules.create(s, "deb", "img", memory="256M")
    inst = s.instance_dir("deb")
    inst.mkdir(parents=True)
    s.catalogue.add_instance(InstanceRow(capsule="deb", version=1, domain="d-deb", leaves=[], chains=[],
                                         accel="tcg", dir=str(inst)))
    yield s
    s.close()


def guest(store: Store, answer: Callable[[list[str], dict[str, Any]], Any]) -> ExecAgent:
    return ExecAgent(store.instance_dir("deb") / "agent.sock", answer)


def made_files(store: Store) -> list[str]:
    """Files a copy would have made: in the store's tmp/ and lent disks in the instance directory."""
    return sorted(p.name for p in store.tmp_dir.iterdir()) + \
        sorted(p.name for p in store.instance_dir("deb").glob("lent-*"))


OLD_LAYER_REFUSES = {"exit_code": 2, "stdout": "", "timed_out": False,
                     "stderr": "usage: python3 -m pods [-h] ...\npython3 -m pods: error: unrecognized arguments: --to"}


def checkpointing(result: dict[str, Any]) -> Callable[[list[str], dict[str, Any]], Any]:
    """A pod layer before "direct" (0.1.0): its command line refuses ``--to``, its images go through a file."""
    def answer(argv: list[str], _args: dict[str, Any]) -> Any:
        if "--to" in argv:
            return OLD_LAYER_REFUSES
        if argv[:4] == ["python3", "-m", "pods", "checkpoint"]:
            return pods_says(result)
        if argv[:4] == ["python3", "-m", "pods", "restore"]:
            return pods_says({"name": "web", "ip": "10.77.0.5/24", "state": "running", "seconds": 0.1})
        return done()
    return answer


class Lent:
    """A lent disk the guest takes (its size recorded), its device the host's file itself."""

    def __init__(self, path: Path, sizes: list[int]) -> None:
        self.guest_device = str(path)
        sizes.append(path.stat().st_size)

    def __enter__(self) -> Lent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("size", [CAP + 1, 1 << 62, 10 ** 30])
def test_a_checkpoint_claiming_more_than_the_cap_is_refused_before_any_file_or_copy(store, size, monkeypatch):
    lent: list[int] = []
    monkeypatch.setattr(Relay, "_lend", lambda self, path, writable: Lent(path, lent))
    fake = guest(store, checkpointing(checkpoint_result(size=size)))
    with pytest.raises(AgentReplyInvalid, match=f"'size' should be a whole number from 0 to {CAP}"):
        ops.checkpoint(store, "deb/web")
    assert made_files(store) == [] and lent == [CAP]   # only the disk the old pod layer would not write on
    assert fake.ran("dd ") == [] and fake.ran("base64") == []
    # the pod is put back where it was, from its image, and the image goes
    assert ["python3", "-m", "pods", "restore", GOOD_PATH] in fake.argvs
    assert ["sh", "-c", f"rm -f {GOOD_PATH}"] in fake.argvs


@pytest.mark.parametrize("path", ["/etc/shadow", "/var/lib/pods/out/other-20250101T120000-42.pod",
                                  "/var/lib/pods/out/web-20250101T120000-42.pod/../../../../etc/shadow",
                                  "/var/lib/pods/out/web-x; rm -rf /.pod", 7, None])
def test_a_checkpoint_naming_a_path_the_host_did_not_ask_about_is_refused_and_left_alone(store, path):
    fake = guest(store, checkpointing(checkpoint_result(path=path)))
    with pytest.raises(AgentReplyInvalid, match="'path' should be text matching"):
        ops.checkpoint(store, "deb/web")
    assert made_files(store) == []
    assert fake.argvs == [["python3", "-m", "pods", "checkpoint", "web"]]   # nothing read, restored or removed


def test_a_lent_disk_is_the_size_claimed_under_the_cap_and_a_chunk_longer_than_asked_is_refused(store, monkeypatch):
    size = LEND_FROM_OUT + 5000   # a lent disk is tried first
    lent: list[int] = []

    def no_disk(self: Relay, path: Path, writable: bool) -> Lent:
        if path.stat().st_size == CAP:   # the disk for a direct checkpoint: taken, the old pod layer refuses it
            return Lent(path, lent)
        lent.append(path.stat().st_size)
        raise HotDiskUnavailable("no hot-plug in this guest")

    def answer(argv: list[str], _args: dict[str, Any]) -> Any:
        if argv[:2] == ["sh", "-c"] and argv[2].startswith("dd "):
            count = int(argv[2].split("count=")[1].split()[0])
            return done(base64.b64encode(b"x" * (count + (1 << 20))).decode())   # more than asked
        return checkpointing(checkpoint_result(size=size))(argv, _args)

    monkeypatch.setattr(Relay, "_lend", no_disk)
    fake = guest(store, answer)
    with pytest.raises(AgentReplyInvalid, match="bytes where .* were asked for"):
        ops.checkpoint(store, "deb/web")
    assert lent == [CAP, -(-size // 512) * 512] and lent[1] <= CAP
    assert made_files(store) == []
    assert ["python3", "-m", "pods", "restore", GOOD_PATH] in fake.argvs   # the copy failed: the pod runs on

    dest = store.tmp_dir / "direct"
    relay = Relay(store, "deb")
    with pytest.raises(AgentReplyInvalid):
        relay.download(GOOD_PATH, 3 << 20, dest, lend=False)
    assert dest.stat().st_size <= 3 << 20


@pytest.mark.parametrize(("stdout", "kind"), [
    (json.dumps({"ok": True}), AgentReplyInvalid),                                   # no result
    (json.dumps({"ok": False, "kind": ["criu_failed"], "error": "x"}), PodFailed),   # an unhashable kind
    (json.dumps({"ok": True, "result": 5}), AgentReplyInvalid),                      # ls: not a list
    (json.dumps({"ok": True, "result": [5]}), AgentReplyInvalid),
    (json.dumps({"ok": True, "result": [{"name": "web", "ip": "junk", "state": "running"}]}), AgentReplyInvalid),
    (json.dumps({"ok": True, "result": [{"name": "web", "ip": 5, "state": "running"}]}), AgentReplyInvalid),
    (json.dumps({"ok": True, "result": [{"name": ["web"], "ip": "10.77.0.5/24", "state": "x"}]}),
     AgentReplyInvalid),
])
def test_malformed_pod_layer_replies_are_typed_errors(store, stdout, kind):
    guest(store, lambda _argv, _args: done(stdout + "\n"))
    with pytest.raises(kind):
        ops.ls(store, "deb")


def test_a_malformed_pod_list_is_a_502_with_the_code_through_the_agent(store):
    guest(store, lambda _argv, _args: done(json.dumps({"ok": True, "result": [{"name": "web", "ip": {"a": 1},
                                                                               "state": "running"}]}) + "\n"))
    client = TestClient(create_app(store.home, TOKEN))
    r = client.get("/v1/pods", params={"capsule": "deb"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 502, r.text
    assert r.json()["error"] == "guest_agent_reply_invalid" and "'ip'" in r.json()["detail"]


def test_a_guest_cannot_rename_the_capsule_in_a_result(store):
    guest(store, lambda _argv, _args: done(json.dumps({"ok": True, "result": {"capsule": "other", "state": "x"}})
                                           + "\n"))
    assert ops.suspend(store, "deb/web") == {"capsule": "deb", "state": "x"}


@pytest.mark.parametrize("result", [
    {"exit_code": 0, "stdout": 5}, {"exit_code": "0", "stdout": ""}, {"exit_code": 0, "stderr": ["x"]},
    {"exit_code": 0, "timed_out": "no"}, {"exit_code": 1.5}, {"exit_code": True}, {"signal": -1},
])
def test_malformed_exec_results_are_typed_errors(store, result):
    guest(store, lambda _argv, _args: result)
    with pytest.raises(AgentReplyInvalid):
        Relay(store, "deb").sh("true")


@pytest.mark.parametrize("printed", ["", "\n", "not-a-digest  x\n", "0" * 63 + "  x"])
def test_a_digest_that_is_not_one_is_a_typed_error(store, printed):
    guest(store, lambda _argv, _args: done(printed))
    with pytest.raises(AgentReplyInvalid, match="not a sha256 digest"):
        Relay(store, "deb").sha256("/x")


def test_base64_garbage_in_a_copy_is_a_typed_error(store):
    guest(store, lambda argv, _args: done("@@not base64@@") if argv[-1].startswith("dd ") else done())
    with pytest.raises(AgentReplyInvalid, match="other than base64"):
        Relay(store, "deb").download(GOOD_PATH, 100, store.tmp_dir / "x", lend=False)


class FakeDomain:
    def maxMemory(self) -> int:  # noqa: N802 (libvirt's name)
        return 256 << 10


@pytest.mark.parametrize("answer", [{"held_bytes": "lots"}, {"held_bytes": [1]}, {"held_bytes": 1 << 40},
                                    {"held_bytes": 1, "stop_reason": {"x": 1}}, {"MemTotal": "a"}])
def test_a_malformed_balloon_reply_skips_the_balloon(store, answer):
    def serve(conn: socket.socket) -> None:
        for req, _n in requests(conn):
            conn.sendall(json.dumps({"id": req["id"], "ok": True,
                                     "result": {} if req["cmd"] == "ping" else answer}).encode() + b"\n")

    sock = store.instance_dir("deb") / "agent.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))
    listener.listen(4)

    def loop() -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                serve(conn)

    threading.Thread(target=loop, daemon=True).start()
    method = "virtio" if "MemTotal" in answer else "agent"
    result = balloon.inflate(sock, FakeDomain(), "cache", method)
    assert result.skipped and "guest" in result.skipped and result.held_bytes == 0


def test_the_reply_reader():
    r = Reply({"n": 3.0, "f": 1.5, "t": "ab", "b": False, "z": None}, "test")
    assert r.integer("n") == 3 and r.number("f") == 1.5 and r.text("t") == "ab" and r.flag("b") is False
    assert r.integer("z", nullable=True) is None and r.integer("missing", default=9) == 9
    for call in (lambda: r.integer("f"), lambda: r.integer("b"), lambda: r.integer("n", hi=2),
                 lambda: r.text("n"), lambda: r.flag("t"), lambda: r.integer("missing"), lambda: r.integer("z"),
                 lambda: r.number("t"), lambda: Reply([1], "test")):
        with pytest.raises(AgentReplyInvalid, match="test"):
            call()
    assert exec_result({}) == {"exit_code": None, "signal": None, "timed_out": False, "stdout": "", "stderr": ""}


def test_the_guests_steps_come_through_checked():
    """Where a checkpoint's time went in the guest (``steps``) reaches the host's result as numbers."""
    steps = {"check": 0.0, "dump": 0.7, "stop": 0.07, "pack": 0.33, "clean": 0.04}
    got = replies.dumped(checkpoint_result(steps=steps), "deb", "web", CAP)
    assert got.steps == steps
    assert replies.dumped(checkpoint_result(), "deb", "web", CAP).steps == {}   # an older pod layer sends none
    back = replies.restored({"name": "web", "ip": "10.77.0.5/24", "state": "running", "seconds": 1.0,
                             "steps": {"unpack": 0.4, "criu": 0.8}}, "deb")
    assert back["steps"] == {"unpack": 0.4, "criu": 0.8}


@pytest.mark.parametrize("steps", [[1, 2], {"dump": "fast"}, {"dump": -1}, {"dump": True}, {"Dump; rm": 1.0},
                                   {f"s{i}": 0.1 for i in range(17)}, {"dump": 1e9}],
                         ids=["list", "text", "negative", "bool", "name", "too-many", "too-long"])
def test_malformed_steps_are_refused_before_any_copy(store, monkeypatch, steps):
    lent: list[int] = []
    monkeypatch.setattr(Relay, "_lend", lambda self, path, writable: Lent(path, lent))
    fake = guest(store, checkpointing(checkpoint_result(steps=steps)))
    with pytest.raises(AgentReplyInvalid, match="'steps' should be"):
        ops.checkpoint(store, "deb/web")
    assert made_files(store) == [] and fake.ran("dd ") == []
    assert lent == [CAP]   # only the disk the old pod layer would not write on
    assert ["python3", "-m", "pods", "restore", GOOD_PATH] in fake.argvs   # the pod runs on where it was
