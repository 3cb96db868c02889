"""The disk server's native read path (diskserver/fastread/: an nbdkit filter in front of the Python
plugin): the same bytes as the plugin alone for any read, hits served natively and misses by the plugin,
every request counted once in the stats, the read-ahead state shared, and a map it cannot read leaving
every read to the plugin. Real nbdkit, a real agent as the source; no guest."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from diskserver.chain import ReadaheadSpec
from diskserver.nbdclient import NbdClient
from diskserver.server import FASTREAD
from hashcache.blocks import BLOCK_SIZE
from tests.tools import test_diskserver_chain as chain_tests
from tests.tools import test_diskserver_server as server_tests
from tests.tools.test_diskserver_chain import host_b, make_child, raw_of, remote_spec
from tests.tools.test_diskserver_server import serve, stats_after
from tests.wait import wait_until

pytestmark = pytest.mark.tools

source = chain_tests.source
sockdir = server_tests.sockdir


@pytest.fixture(scope="module", autouse=True)
def built():
    """The filter as `make native` builds it (a fresh checkout may run this before make native)."""
    subprocess.run(["make", "-s", "-C", str(FASTREAD.parent)], check=True)
    assert FASTREAD.is_file()


def _settled(server) -> dict:  # noqa: ANN001
    """Stats once every fetched block is in its shadow (its bit set: the filter serves it from then on)."""
    def done() -> dict | None:
        s = server.stats()
        return s if s and s["pending_blocks"] == 0 and s["persisted_blocks"] >= s["source_blocks"] else None

    return wait_until(done, 20, lambda: f"fetched blocks to be persisted (last: {server.stats()})")


def _reads(rng: random.Random, size: int, n: int) -> list[tuple[int, int]]:
    """Reads of every shape a client sends: single blocks, 64 KiB, 1 MiB, and unaligned spans."""
    out = []
    for _ in range(n):
        shape = rng.randrange(4)
        if shape == 0:
            off, length = rng.randrange(size // BLOCK_SIZE) * BLOCK_SIZE, BLOCK_SIZE
        elif shape == 1:
            off, length = rng.randrange(size // 65536) * 65536, 65536
        elif shape == 2:
            off, length = rng.randrange(size // (1 << 20)) * (1 << 20), 1 << 20
        else:
            off = rng.randrange(size - 1)
            length = rng.randrange(1, min(300_000, size - off) + 1)
        out.append((off, min(length, size - off)))
    return out


@pytest.mark.timeout(600)
def test_native_path_serves_the_same_bytes_as_the_plugin_and_counts_each_request_once(source, sockdir):
    b = host_b(source)
    child = make_child(source, b)  # a local layer over the remote root: local, shadow and zero runs
    spec = remote_spec(source, b, children=[child])
    want = raw_of(Path(child.local_path), b / "want.raw")
    reads = _reads(random.Random(11), len(want), 160)
    asked = sum(n for _, n in reads)
    with serve(spec, b, sockdir, "native") as server, NbdClient(str(server.socket_path)) as nbd:
        assert f"--filter={FASTREAD}" in server.command()
        for off, n in reads:  # first pass: misses go to the plugin, what is already local is served natively
            assert nbd.pread(off, n) == want[off:off + n], (off, n)
        stats_after(server, len(reads))
        first = _settled(server)
        for off, n in reads:  # second pass: every block is local or in its shadow now
            assert nbd.pread(off, n) == want[off:off + n], (off, n)
        s = stats_after(server, 2 * len(reads))
    assert first["native_passed"] > 0 and first["miss_blocks"] > 0
    assert s["requests"] == 2 * len(reads) and s["guest_bytes"] == 2 * asked
    assert s["native_reads"] - first["native_reads"] == len(reads), "the second pass is all hits"
    assert s["fetch_requests"] == first["fetch_requests"]
    assert s["local_blocks"] > 0 and s["shadow_blocks"] > 0 and s["zero_blocks"] > 0
    assert not Path(f"{b / 'native.json'}.fastmap").exists(), "the map goes with the server"

    # the plugin alone (no filter) serves the same bytes; its stats have no native figures
    with serve(spec, b, sockdir, "plain", native=False) as server, NbdClient(str(server.socket_path)) as nbd:
        assert not any(a.startswith("--filter") for a in server.command())
        for off, n in reads[:40]:
            assert nbd.pread(off, n) == want[off:off + n], (off, n)
        s = stats_after(server, 40)
        assert "native_reads" not in s and s["requests"] == 40


@pytest.mark.timeout(300)
def test_hits_served_natively_advance_the_plugins_read_ahead(source, sockdir):
    b = host_b(source)
    data = sorted(source.data_blocks())
    runs, start = [], data[0]
    for prev, cur in zip(data, data[1:], strict=False):
        if cur != prev + 1:
            runs.append((start, prev + 1))
            start = cur
    runs.append((start, data[-1] + 1))
    a, stop = max(runs, key=lambda r: r[1] - r[0])
    assert stop - a >= 80, "the tiny layer has a run of 80 data blocks"
    spec = remote_spec(source, b, readahead=ReadaheadSpec(4, 64), prefetch=False)
    with serve(spec, b, sockdir) as server, NbdClient(str(server.socket_path)) as nbd:
        for i in range(a + 7, a - 1, -1):  # backwards: never sequential, so exactly these 8 are fetched
            nbd.pread(i * BLOCK_SIZE, BLOCK_SIZE)
        stats_after(server, 8)
        s1 = _settled(server)
        assert s1["readahead_blocks"] == 0 and s1["source_blocks"] == 8
        for i in range(a, a + 8):  # forwards, all hits: served natively, each one sequential
            nbd.pread(i * BLOCK_SIZE, BLOCK_SIZE)
        nbd.pread((a + 8) * BLOCK_SIZE, BLOCK_SIZE)  # the first miss: its window grew through the hits
        s2 = stats_after(server, 17)
    assert s2["native_reads"] == 8
    # through the hits the window doubled to its cap (64); without them noted it would be min_blocks (4)
    assert s2["readahead_blocks"] >= 32, s2


@pytest.mark.timeout(300)
def test_a_map_the_filter_cannot_read_leaves_every_read_to_the_plugin(source, sockdir):
    b = host_b(source)
    want = source.ref
    with serve(remote_spec(source, b), b, sockdir) as server:
        mapfile = Path(f"{server.spec_path}.fastmap")
        assert mapfile.is_file()
        # replaced before the first read (the filter loads it then): a foreign file of the right size
        bad = mapfile.with_name("bad")
        bad.write_bytes(os.urandom(mapfile.stat().st_size))
        os.replace(bad, mapfile)
        with NbdClient(str(server.socket_path)) as nbd:
            for off, n in _reads(random.Random(5), len(want), 30):
                assert nbd.pread(off, n) == want[off:off + n]
        s = stats_after(server, 30)
        assert s["requests"] == 30 and s["native_reads"] == 0 and s["native_passed"] == 0
        assert "is not a map this filter reads; every read goes through the plugin" in server.log_tail(50)
