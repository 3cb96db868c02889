"""The root helper's fixed command set (capsule/privsep/helper.py), over a real socket pair: each command works
on a path in the store's tmp/; `..`, symbolic links out of the store, paths elsewhere, unknown commands and
oversized requests are refused with a clear error, and change nothing."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from capsule import sandbox
from capsule.errors import Error, InvalidInput
from capsule.privsep import helper, ops
from capsule.runtime import podnet

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

OWNER = ops.Owner(4242, 4343)   # the store's owner (not root): what the helper hands files to


@pytest.fixture
def store(tmp_path):
    home = tmp_path / "store"
    (home / "tmp").mkdir(parents=True)
    (home / "catalogue.sqlite").write_bytes(b"root's")
    return home


@pytest.fixture
def client(store):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    t = threading.Thread(target=helper.serve, args=(theirs, helper.Helper(store, OWNER)), daemon=True)
    t.start()
    yield helper.HelperClient(ours)
    ours.close()
    t.join(5)
    assert not t.is_alive(), "the helper ends when the agent closes its end"
    theirs.close()


def raw(client: helper.HelperClient, data: bytes, fds: list[int] | None = None) -> dict:
    """Send ``data`` as it is (with ``fds``), the answer's socket first, and read the answer."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with mine, theirs:
        socket.send_fds(client.sock, [data], [theirs.fileno(), *(fds or [])])
        theirs.close()
        return json.loads(mine.recv(helper.MAX_REPLY))


def owner_of(path: Path) -> tuple[int, int, int]:
    st = path.lstat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def test_adopt_memory_image_gives_a_new_image_to_the_store_owner(store, client):
    image = store / "tmp" / "abc.save"
    image.write_bytes(b"LibvirtQemudSave")
    os.chmod(image, 0o400)
    client.adopt_memory_image(image)
    assert owner_of(image) == (OWNER.uid, OWNER.gid, 0o600)


def test_sandbox_hand_over_and_the_pod_bridge(store, client, monkeypatch):
    work = store / "tmp" / "w1.sandbox"
    work.mkdir(mode=0o700)
    os.chown(work, OWNER.uid, OWNER.gid)
    (work / "disk.raw").write_bytes(b"\0" * 4096)
    client.sandbox_hand_over(work / "disk.raw")
    uid, gid = sandbox.ids()
    assert owner_of(work) == (OWNER.uid, gid, 0o710)
    assert owner_of(work / "disk.raw") == (uid, gid, 0o600)
    monkeypatch.setattr(podnet, "ensure_bridge", lambda: podnet.BRIDGE)  # the real one changes the host's links
    assert client.pod_bridge_up() == podnet.BRIDGE


def refusals(store: Path) -> list[tuple[str, str, str]]:
    """(op, path, what the refusal says)"""
    tmp = store / "tmp"
    return [
        ("adopt-memory-image", f"{tmp}/../catalogue.sqlite", "`..`"),
        ("adopt-memory-image", "/etc/passwd", "not in the store's tmp/"),
        ("adopt-memory-image", f"{store}/catalogue.sqlite", "not in the store's tmp/"),
        ("adopt-memory-image", "tmp/abc.save", "not an absolute path"),
        ("adopt-memory-image", f"{tmp}/out.save", "symbolic link"),          # a link to a file elsewhere
        ("adopt-memory-image", f"{tmp}/abc.qcow2", "not a new memory image"),
        ("sandbox-hand-over", f"{tmp}/link.sandbox/passwd", "symbolic link"),  # a link to a directory elsewhere
        ("sandbox-hand-over", f"{tmp}/w.sandbox/inner/disk.raw", "not a file directly"),
        ("sandbox-hand-over", f"{tmp}/abc.save", "not in a sandbox work directory"),
    ]


def test_paths_outside_the_store_tmp_are_refused_and_nothing_changes(store, client, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_text("x")
    (outside / "secret.save").write_text("x")
    (store / "tmp" / "out.save").symlink_to(outside / "secret.save")
    (store / "tmp" / "link.sandbox").symlink_to(outside)
    (store / "tmp" / "abc.qcow2").write_bytes(b"q")
    before = {p: owner_of(p) for p in (*outside.iterdir(), store / "catalogue.sqlite", store / "tmp" / "abc.qcow2",
                                       Path("/etc/passwd"))}
    for op, path, says in refusals(store):
        answer = raw(client, json.dumps({"op": op, "path": path}).encode())
        assert answer["ok"] is False and answer["code"] == InvalidInput.code, (op, path, answer)
        assert says in answer["error"], (op, path, answer)
    assert {p: owner_of(p) for p in before} == before


def test_unknown_commands_oversized_and_malformed_requests_are_refused(store, client):
    answer = raw(client, json.dumps({"op": "shell", "argv": ["sh"]}).encode())
    assert not answer["ok"] and "unknown command 'shell'" in answer["error"] and "run-sandboxed" in answer["error"]
    big = json.dumps({"op": "pod-bridge-up", "pad": "x" * (helper.MAX_REQUEST + 10)}).encode()
    answer = raw(client, big)
    assert not answer["ok"] and f"larger than {helper.MAX_REQUEST} bytes" in answer["error"]
    for junk in (b"not json", b"[1, 2]", b"\xff\xfe"):
        answer = raw(client, junk)
        assert not answer["ok"] and "one JSON object" in answer["error"]
    # it still answers well-formed requests afterwards
    image = store / "tmp" / "def.save"
    image.write_bytes(b"x")
    client.adopt_memory_image(image)
    assert image.stat().st_uid == OWNER.uid


def test_run_sandboxed_runs_only_e2fsck_and_debugfs_in_a_work_directory(store, client, tmp_path):
    work = store / "tmp" / "w2.sandbox"
    work.mkdir()
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        cases = [({"argv": ["cat", "/etc/shadow"], "cwd": str(work)}, [out], "debugfs or e2fsck only"),
                 ({"argv": ["sh", "-c", "id"], "cwd": str(work)}, [out], "debugfs or e2fsck only"),
                 ({"argv": ["debugfs", "-R", "ls", "disk.raw"], "cwd": str(work)}, [], "needs the descriptor"),
                 ({"argv": ["debugfs", "disk.raw"], "cwd": "/etc"}, [out], "not in the store's tmp/"),
                 ({"argv": ["debugfs", "disk.raw"], "cwd": str(store / "tmp")}, [out], "not in the store's tmp/"),
                 ({"argv": ["debugfs"] * 40, "cwd": str(work)}, [out], "up to 15 string arguments"),
                 ({"argv": ["debugfs", "x"], "cwd": str(work), "timeout": 1e9}, [out], "a timeout of up to")]
        for args, fds, says in cases:
            answer = raw(client, json.dumps({"op": "run-sandboxed", **args}).encode(), fds)
            assert not answer["ok"] and says in answer["error"], (args, answer)
        with pytest.raises(Error, match="debugfs or e2fsck only"):
            client.run_sandboxed(["cat", "/etc/shadow"], work, out, timeout=5)
    finally:
        os.close(out)
    assert (tmp_path / "out").read_bytes() == b""


def test_a_slow_request_does_not_hold_up_the_others(store, client, monkeypatch):
    """Requests run side by side: a memory image is adopted while a long one (here the bridge) still runs."""
    release = threading.Event()
    monkeypatch.setattr(podnet, "ensure_bridge", lambda: (release.wait(20), podnet.BRIDGE)[1])
    slow = threading.Thread(target=client.pod_bridge_up)
    slow.start()
    image = store / "tmp" / "ghi.save"
    image.write_bytes(b"x")
    client.adopt_memory_image(image)
    assert image.stat().st_uid == OWNER.uid and slow.is_alive()
    release.set()
    slow.join(10)
    # a request with no socket to answer on is dropped; the helper goes on
    socket.send_fds(client.sock, [b'{"op": "pod-bridge-up"}'], [])
    assert client.pod_bridge_up() == podnet.BRIDGE


def test_open_serial_hands_back_the_pty_libvirt_names_for_this_stores_domain_only(store, client, monkeypatch):
    """An unprivileged agent cannot open QEMU's pty (QEMU's user owns it, mode 0620): the helper opens the serial
    console of one of this store's domains, at the pty libvirt names for it, and sends the descriptor back."""
    (store / "store.json").write_text(json.dumps({"id": "ab12cd34"}))
    master, slave = os.openpty()
    asked: list[str] = []

    def open_serial(domain: str) -> int:
        asked.append(domain)
        return os.dup(slave)

    monkeypatch.setattr(ops, "open_serial", open_serial)
    try:
        fd = client.open_serial("capsule-ab12cd34-desk", Path("/dev/pts/whatever-the-agent-says"))
        try:
            os.write(fd, b"typed\n")
            assert os.read(master, 100).startswith(b"typed")      # the descriptor is the pty's, working
        finally:
            os.close(fd)
        assert asked == ["capsule-ab12cd34-desk"]                   # the helper looked the domain up itself
        for domain in ("capsule-ffff0000-desk", "capsule-ab12cd34-../x", "capsule-ab12cd34-", "qemu-1", None):
            answer = raw(client, json.dumps({"op": "open-serial", "domain": domain}).encode())
            assert not answer["ok"] and "not a domain of this store" in answer["error"], domain
        assert asked == ["capsule-ab12cd34-desk"]
    finally:
        os.close(master)
        os.close(slave)


def test_connect_agent_connects_to_a_capsules_agent_socket_of_this_store_only(store, client, monkeypatch):
    """libvirt makes a capsule's guest agent socket root's (mode 0775), so an unprivileged agent cannot connect to
    it (the dashboard's clipboard, screen size and pointer, a balloon, a freeze): the helper connects to the agent
    socket of one of this store's capsules, for its domain, and sends the connected socket back."""
    (store / "store.json").write_text(json.dumps({"id": "ab12cd34"}))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    asked: list[tuple[str, Path, float]] = []

    def connect_agent(domain: str, path: Path, timeout: float) -> int:
        asked.append((domain, path, timeout))
        return os.dup(theirs.fileno())

    monkeypatch.setattr(ops, "connect_agent", connect_agent)
    sock = store / "instances" / "desk" / "agent.sock"
    with ours, theirs:
        got = client.connect_agent(sock, 5.0)
        with got:
            got.sendall(b'{"op": "ping"}\n')
            assert ours.recv(100) == b'{"op": "ping"}\n'           # the socket handed back is the connection
        assert asked == [("capsule-ab12cd34-desk", sock, 5.0)]       # the domain is the helper's own lookup
        elsewhere = [store / "instances" / "desk" / "other.sock", store / "tmp" / "desk" / "agent.sock",
                     store / "instances" / ".." / "x" / "agent.sock", store / "instances" / "a" / "b" / "agent.sock",
                     Path("/run/libvirt/libvirt-sock"), Path("agent.sock"), store / "instances" / "../agent.sock"]
        for path in elsewhere:
            answer = raw(client, json.dumps({"op": "connect-agent", "path": str(path), "timeout": 5}).encode())
            assert not answer["ok"] and "not a capsule's agent socket in this store" in answer["error"], path
        for timeout in (0, -1, float("nan"), 1e9, "5", None):
            answer = raw(client, json.dumps({"op": "connect-agent", "path": str(sock), "timeout": timeout}).encode())
            assert not answer["ok"] and "timeout" in answer["error"], timeout
        assert len(asked) == 1
