"""The memory codec on the tunnel's qemu-migration channel between a source and a real destination agent
(capsule/migrate/tunnel.py, capsule/exchange/tunnel.py, capsule/migrate/ramdedup.py): negotiated when the
session opens, the stream QEMU reads there rebuilt byte for byte from references to blocks the destination's
store holds, a reference it cannot resolve cutting the stream with the reason, the other channels untouched."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from capsule.agent.launch import AgentProcess
from capsule.migrate.ramdedup import Known
from capsule.migrate.tunnel import CHUNK
from capsule.migrate.tunnelset import Dedup, open_tunnels
from capsule.store import Store
from hashcache.blocks import hash_block
from hashcache.manifest import manifest_of_file
from tests.helpers.migstream import StreamWriter, guest_order
from tests.wait import wait_until

pytestmark = [pytest.mark.tools, pytest.mark.timeout(180)]


class Sink:
    """A unix socket standing in for the destination QEMU's: keeps every byte of its one connection."""

    def __init__(self, path: Path) -> None:
        self.data, self.done = bytearray(), threading.Event()
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen(1)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            try:
                while chunk := conn.recv(1 << 16):
                    self.data += chunk
            except OSError:
                pass
        self.done.set()


@pytest.fixture
def dest(tmp_path) -> Iterator[tuple[AgentProcess, Path, Store]]:
    short = Path(tempfile.mkdtemp(prefix="tun-", dir="/tmp"))
    short.chmod(0o711)
    env = {**os.environ, "CAPSULE_TUNNEL_DIR": str(short / "run"), "CAPSULE_QEMU_USER": "root",
           "CAPSULE_LIBVIRT_SOCKET": str(short / "none.sock")}
    agent = AgentProcess(tmp_path / "dest", tmp_path / "dest.token", env=env)
    store = Store.open(tmp_path / "dest")
    yield agent, short, store
    agent.stop()
    store.close()
    shutil.rmtree(short, ignore_errors=True)


def _held(store: Store, tmp_path: Path, n: int) -> list[bytes]:
    """``n`` random pages in a file of the destination's store, in its hash cache."""
    pages = [os.urandom(4096) for _ in range(n)]
    f = store.home / "tmp" / "held.bin"
    f.parent.mkdir(exist_ok=True)
    f.write_bytes(b"".join(pages))
    store.hash_cache().insert_file(f, [hash_block(p) for p in pages])
    store.hash_cache().sync()
    return pages


def _stream(pages: list[bytes]) -> bytes:
    w = StreamWriter().config().ram_start().ram_part()
    for i, p in enumerate(pages):
        w.page(p, offset=i * 4096).zero(offset=(4000 + i) * 4096)
    return w.eos().ram_part(end=True).eos().device(3, "cpu", os.urandom(400)).end().bytes()


def _send(dedup: Dedup | None, agent: AgentProcess, short: Path, data: bytes) -> tuple[Any, Sink]:
    peer = SimpleNamespace(url=agent.url, token=agent.token, fingerprint=None)
    t = open_tunnels(peer, ("qemu-migration",), local_dir=short / "src", dedup=dedup)
    sink = Sink(Path(t.remote_paths["qemu-migration"]))
    with socket.socket(socket.AF_UNIX) as c:
        c.connect(str(t.tunnels["qemu-migration"].path))
        c.sendall(data)
        c.shutdown(socket.SHUT_WR)
        c.settimeout(60)
        while c.recv(1 << 16):
            pass
    assert sink.done.wait(60)
    return t, sink


def _known(pages: list[bytes]) -> Known:
    return Known(int.from_bytes(hash_block(p)[:8], "little") for p in pages)


def test_pages_the_destination_holds_cross_as_references_and_qemu_gets_the_exact_stream(dest, tmp_path):
    agent, short, store = dest
    held = _held(store, tmp_path, 300)
    fresh = [os.urandom(4096) for _ in range(100)]
    data = _stream(held + fresh)
    t, sink = _send(Dedup([], _known(held)), agent, short, data)
    with t:
        assert t.dedup
        assert bytes(sink.data) == data
        m = t.memory
        assert (m.refs, m.raw_pages, m.stream_bytes) == (300, 100, len(data))
        wait_until(lambda: t.bytes_sent == m.wire_bytes, 10, "the frames counted as sent")
        assert t.bytes_sent < 100 * 4096 + 300 * 40 + 20_000 < len(data) // 3


def test_a_block_the_destination_lacks_cuts_the_stream_naming_it(dest, tmp_path):
    agent, short, store = dest
    held = _held(store, tmp_path, 10)
    stranger = os.urandom(4096)                       # "known" to the source, but nowhere at the destination
    data = _stream(held + [stranger])
    t, sink = _send(Dedup([], _known([*held, stranger])), agent, short, data)
    with t:
        assert len(sink.data) < len(data)             # QEMU read a cut stream: its migration fails
        wait_until(lambda: t.tunnels["qemu-migration"].errors, 10, "the reason at the source")
        assert hash_block(stranger).hex()[:40] in " ".join(t.tunnels["qemu-migration"].errors)


def test_without_dedup_the_bytes_cross_as_they_came(dest, tmp_path):
    agent, short, _store = dest
    data = _stream([os.urandom(4096) for _ in range(20)])
    t, sink = _send(None, agent, short, data)
    with t:
        assert not t.dedup and bytes(sink.data) == data
        wait_until(lambda: t.bytes_sent == len(data), 10, "every byte sent as it came")
        assert t.memory.wire_bytes == 0


def _sealed(store: Store, pages: list[bytes], name: str) -> str:
    """A memory image of ``pages`` sealed into ``store`` (its catalogue too): yesterday's, as the destination
    holds it."""
    f = store.home / "tmp" / name
    f.parent.mkdir(exist_ok=True)
    f.write_bytes(b"".join(pages))
    row = store.seal_file(f, "memory")
    store.catalogue.add_file(row)
    return row.id


def test_a_commute_sends_yesterdays_pages_as_runs_of_its_image_and_qemu_gets_the_exact_stream(dest, tmp_path):
    agent, short, store = dest
    yesterday = [os.urandom(4096) for _ in range(600)]
    today = [os.urandom(4096) if i % 100 == 7 else p for i, p in enumerate(yesterday)]   # 6 pages changed
    fid = _sealed(store, yesterday, "yesterday.mem")
    known = Known.of_manifests([manifest_of_file(store.file_path(fid))])
    data = guest_order(today)
    t, sink = _send(Dedup([("file", fid)], known), agent, short, data)
    with t:
        assert bytes(sink.data) == data
        m = t.memory
        # a run ends where a changed page is, and where a read of the tunnel ends (a call holds nothing back)
        reads = -(-len(data) // CHUNK)
        assert (m.refs, m.raw_pages) == (594, 6) and 7 <= m.runs <= 7 + reads
        wait_until(lambda: t.bytes_sent == m.wire_bytes, 10, "the frames counted as sent")
        # the 6 new pages and little else (as hashes, the held pages took 594 × (33 + 5) bytes more)
        assert t.bytes_sent < 6 * 4096 + (7 + reads) * 60 + 3000, t.bytes_sent


def test_a_run_of_an_image_the_destination_lacks_cuts_the_stream_naming_it(dest, tmp_path):
    agent, short, store = dest
    pages = [os.urandom(4096) for _ in range(20)]
    elsewhere = Store.open(tmp_path / "elsewhere")       # the source believes the destination holds it
    try:
        fid = _sealed(elsewhere, pages, "other.mem")
        known = Known.of_manifests([manifest_of_file(elsewhere.file_path(fid))])
    finally:
        elsewhere.close()
    t, sink = _send(Dedup([("file", fid)], known), agent, short, guest_order(pages))
    with t:
        assert len(sink.data) < len(guest_order(pages)) - 20 * 4096 + 4096   # QEMU read a cut stream
        wait_until(lambda: t.tunnels["qemu-migration"].errors, 10, "the reason at the source")
        assert f"file {fid[:12]}, which this host does not hold" in " ".join(t.tunnels["qemu-migration"].errors)
