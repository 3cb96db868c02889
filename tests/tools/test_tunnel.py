"""The byte tunnel of live moves between two real agents on loopback (capsule/exchange/tunnel.py on the
destination, capsule/migrate/tunnel.py on the source): bytes both ways intact, many connections at once,
half-close, a real libvirt call, a destination killed mid-stream, its throughput over TLS."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import libvirt
import pytest

from capsule.agent.launch import AgentProcess
from capsule.migrate.tunnelset import Tunnels, open_tunnels
from tests.helpers.unixecho import TRAILER, Echo
from tests.wait import wait_until

pytestmark = [pytest.mark.tools, pytest.mark.timeout(180)]



@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a unix socket's path is at most 107 bytes; pytest's are long)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="tun-", dir="/tmp"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _agent(tmp_path: Path, short_dir: Path, target: Path, *, tls: bool = False) -> AgentProcess:
    env = {**os.environ, "CAPSULE_LIBVIRT_SOCKET": str(target), "CAPSULE_TUNNEL_DIR": str(short_dir / "run"),
           "CAPSULE_QEMU_USER": "root"}     # the echo stands in for QEMU's socket: root's, not libvirt-qemu's
    return AgentProcess(tmp_path / "dest", tmp_path / "dest.token", env=env, tls=tls)


@pytest.fixture
def dest(tmp_path, short_dir):
    echo = Echo(short_dir / "echo.sock")
    agent = _agent(tmp_path, short_dir, echo.path)
    yield agent, echo, short_dir
    agent.stop()
    echo.close()


def _peer(agent: AgentProcess) -> SimpleNamespace:
    return SimpleNamespace(url=agent.url, token=agent.token, fingerprint=agent.fingerprint)


def _connect(t: Tunnels, kind: str = "libvirt") -> socket.socket:
    c = socket.socket(socket.AF_UNIX)
    c.settimeout(60)
    c.connect(str(t.tunnels[kind].path))
    return c


def _through(c: socket.socket, size: int, seed: int = 0) -> tuple[bytes, bytes, int]:
    """Send ``size`` bytes (then half-close) while reading everything back: (sent digest, received digest of
    all but the trailer, trailer found)."""
    got, sent, tail = hashlib.sha256(), hashlib.sha256(), bytearray()
    received = [0]

    def read() -> None:      # all but the last len(TRAILER) bytes hashed as they come
        while data := c.recv(1 << 20):
            tail.extend(data)
            if len(tail) > len(TRAILER):
                got.update(tail[:-len(TRAILER)])
                received[0] += len(tail) - len(TRAILER)
                del tail[:-len(TRAILER)]

    reader = threading.Thread(target=read)
    reader.start()
    block = hashlib.shake_256(seed.to_bytes(4, "little")).digest(1 << 20)
    for _ in range(size >> 20):
        c.sendall(block)
        sent.update(block)
    c.shutdown(socket.SHUT_WR)
    reader.join(120)
    assert not reader.is_alive()
    assert bytes(tail) == TRAILER, "the echo did not see the half-close, or its last bytes were lost"
    assert received[0] == size
    return sent.digest(), got.digest(), received[0]


def test_32_mib_each_way_arrive_intact_and_are_counted(dest):
    agent, echo, _ = dest
    with open_tunnels(_peer(agent), ("libvirt",)) as t:
        assert t.libvirt_uri == f"qemu+unix:///system?socket={t.tunnels['libvirt'].path}"
        with _connect(t) as c:
            sent, got, n = _through(c, 32 << 20)
        assert sent == got and n == 32 << 20
        wait_until(lambda: t.bytes_received == (32 << 20) + len(TRAILER), 10, "every byte back counted")
        assert t.bytes_sent == 32 << 20
    assert echo.accepted == 1 and not t.tunnels["libvirt"].path.exists()


def test_half_close_keeps_the_other_way_open(dest):
    agent, _echo, _ = dest
    with open_tunnels(_peer(agent), ("libvirt",)) as t, _connect(t) as c:
        c.sendall(b"question")
        assert c.recv(64) == b"question"
        c.shutdown(socket.SHUT_WR)                 # no more from here: the echo still answers, then closes
        answer = b""
        while data := c.recv(64):
            answer += data
        assert answer == TRAILER                   # and then EOF: the far end closed


def test_several_connections_at_once(dest):
    agent, echo, _ = dest
    results: dict[int, tuple[bytes, bytes, int]] = {}
    with open_tunnels(_peer(agent), ("libvirt",)) as t:
        def one(i: int) -> None:
            with _connect(t) as c:
                results[i] = _through(c, 4 << 20, seed=i)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    assert len(results) == 6 and all(s == g for s, g, _ in results.values())
    assert len({s for s, _, _ in results.values()}) == 6 and echo.accepted == 6


def test_qemu_channels_go_to_the_path_the_destination_chose(dest):
    """The destination names a path for its QEMU's socket; the source's entrance carries to it (here both ends
    are on one machine, so the source's entrance is elsewhere). A connection that comes before QEMU listens
    waits for it."""
    agent, _echo, short = dest
    with open_tunnels(_peer(agent), ("qemu-migration", "qemu-disks"), local_dir=short / "src") as t:
        remote = Path(t.remote_paths["qemu-migration"])
        assert remote.parent.parent == short / "run" and remote.parent.stat().st_mode & 0o7777 == 0o1770
        assert t.migration_uri == f"unix://{short / 'src' / 'qemu-migration.sock'}"
        assert t.disks_uri == f"unix://{short / 'src' / 'qemu-disks.sock'}"
        late: list[Echo] = []
        threading.Timer(1.0, lambda: late.append(Echo(remote))).start()   # "QEMU" listens a second later
        with _connect(t, "qemu-migration") as c:
            c.sendall(b"migration stream")
            c.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := c.recv(64):
                data += chunk
        assert data == b"migration stream" + TRAILER
        late[0].close()
    assert not remote.parent.exists()              # the session's directory went with it


def test_the_disks_channel_goes_packed_and_arrives_exactly(dest):
    """What the source's QEMU writes to the disks' channel crosses packed (this agent names tunnel-pack) and the
    destination's socket gets every byte as written; its answers come back as they were."""
    agent, _echo, short = dest
    text = b"".join(b"block %08d of a file the guest writes during the move\n" % i for i in range(150_000))
    with open_tunnels(_peer(agent), ("qemu-disks",), local_dir=short / "src") as t:
        assert t.tunnels["qemu-disks"].pack
        far = Echo(Path(t.remote_paths["qemu-disks"]))
        try:
            with _connect(t, "qemu-disks") as c:
                got = bytearray()

                def read() -> None:
                    while data := c.recv(1 << 16):
                        got.extend(data)

                reader = threading.Thread(target=read)
                reader.start()
                for at in range(0, len(text), 100_000):
                    c.sendall(text[at:at + 100_000])
                c.shutdown(socket.SHUT_WR)
                reader.join(60)
            assert bytes(got) == text + TRAILER
            packed = t.disks
            assert packed.raw_bytes == len(text) and packed.wire_bytes < len(text) // 5
            assert t.bytes_sent == packed.wire_bytes
        finally:
            far.close()


def test_deleting_the_session_ends_its_connections_and_refuses_new_ones(dest):
    import httpx

    agent, echo, _ = dest
    with open_tunnels(_peer(agent), ("libvirt",)) as t, _connect(t) as c:
        c.sendall(b"before")
        assert c.recv(64) == b"before"
        r = httpx.delete(f"{agent.url}/v1/tunnel/{t.session}", headers={"Authorization": f"Bearer {agent.token}"})
        assert r.status_code == 200
        c.settimeout(15)
        assert c.recv(64) == b""                   # the live connection ended: EOF here
        with _connect(t) as again:                 # a new one is refused by the peer: EOF at once
            again.settimeout(15)
            assert again.recv(64) == b""
        wait_until(lambda: any("404" in e for e in t.tunnels["libvirt"].errors), 10, "the refusal kept")
    assert echo.accepted == 1


def test_a_real_libvirt_call_goes_through(tmp_path, short_dir):
    agent = _agent(tmp_path, short_dir, Path("/run/libvirt/libvirt-sock"))
    try:
        with open_tunnels(_peer(agent), ("libvirt",)) as t:
            conn = libvirt.open(t.libvirt_uri)
            try:
                assert conn.getLibVersion() >= 6_006_000 and conn.getHostname()
            finally:
                conn.close()
            assert t.bytes_sent > 0 and t.bytes_received > 0
    finally:
        agent.stop()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_destination_killed_mid_stream_ends_the_connection_here(dest):
    agent, _echo, _ = dest
    before = _fds()
    t = open_tunnels(_peer(agent), ("libvirt",))
    c = _connect(t)
    c.sendall(b"x" * 1000)
    assert c.recv(1000)
    os.killpg(agent.proc.pid, 9)
    agent.proc.wait(10)
    c.settimeout(15)
    while c.recv(1 << 16):      # EOF, not a hang
        pass
    c.close()
    started = time.monotonic()
    t.close()                   # the peer is gone: the session's DELETE fails quietly
    assert time.monotonic() - started < 15
    assert all(not x._thread.is_alive() for x in t.tunnels.values())  # noqa: SLF001
    wait_until(lambda: _fds() <= before, 10, lambda: f"the fds back to {before} (now {_fds()})")


@pytest.mark.parametrize("size_mib", [64])
def test_throughput_over_tls(tmp_path, short_dir, size_mib):
    """Not a timed assertion: the figure is printed for the report (pytest -s)."""
    echo = Echo(short_dir / "echo.sock")
    agent = _agent(tmp_path, short_dir, echo.path, tls=True)
    try:
        assert agent.url.startswith("https://")
        with open_tunnels(_peer(agent), ("libvirt",)) as t, _connect(t) as c:
            started = time.monotonic()
            sent, got, _ = _through(c, size_mib << 20)
            seconds = time.monotonic() - started
        assert sent == got
        print(f"\ntunnel over TLS on loopback: {size_mib} MiB each way in {seconds:.2f}s = "
              f"{size_mib / seconds:.1f} MiB/s each way")
    finally:
        agent.stop()
        echo.close()
