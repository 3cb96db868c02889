"""The disk server for real: nbdkit running the Python plugin on a unix socket, read by QEMU's own tools
(qemu-img, qemu-io) — the same NBD client code a guest's disk goes through — with a real agent as the
source host. No guest is booted."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from diskserver.chain import ChainSpec, ReadaheadSpec, RetrySpec
from diskserver.errors import ServerError
from diskserver.nbdclient import NbdClient, probe
from diskserver.server import PLUGIN, DiskServer
from hashcache.blocks import BLOCK_SIZE
from hashcache.shadow import Shadow
from tests.tools import test_diskserver_chain as chain_tests
from tests.tools.test_diskserver_chain import block_of_source, host_b, make_child, raw_of, remote_spec
from tests.wait import wait_until

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[2]

# the two-host fixtures of the chain tests (host A: a store with the tiny image and an agent)
source = chain_tests.source
lying_source = chain_tests.lying_source


@pytest.fixture
def sockdir():
    """A short directory for sockets (a unix socket path is limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="ds-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def serve(spec: ChainSpec, b: Path, sockdir: Path, name: str = "disk", **kw) -> DiskServer:
    spec_path = b / f"{name}.json"
    spec.save(spec_path)
    return DiskServer(spec_path, sockdir / f"{name}.sock", b / f"{name}.log", exit_with_parent=True, **kw).start()


def qemu_io(uri: str, *commands: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    args = ["qemu-io", "-f", "raw", "-r"]
    for c in commands:
        args += ["-c", c]
    return subprocess.run([*args, uri], capture_output=True, text=True, timeout=timeout)


def convert(uri: str, out: Path) -> bytes:
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", uri, str(out)], check=True, timeout=300)
    return out.read_bytes()


def stats_after(server: DiskServer, requests: int, timeout: float = 10.0) -> dict:
    """The server's stats file once it accounts for at least ``requests`` reads."""
    def current() -> dict | None:
        s = server.stats()
        return s if s is not None and s["pid"] == server.pid and s["requests"] >= requests else None

    return wait_until(current, timeout,
                      lambda: f"the server's stats to count {requests} requests (last: {server.stats()})")


def test_qemu_reads_the_flattened_chain(source, sockdir):
    b = host_b(source)
    child = make_child(source, b)
    with serve(remote_spec(source, b), b, sockdir, "root") as server:
        assert probe(str(server.socket_path))
        assert convert(server.uri, b / "out.raw") == source.ref
        info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", "-f", "raw", server.uri],
                                         capture_output=True, text=True, check=True).stdout)
        assert info["virtual-size"] == len(source.ref)
        # block status: zero where no layer has data, data where the root has it
        extents = json.loads(subprocess.run(["qemu-img", "map", "--output=json", "-f", "raw", server.uri],
                                            capture_output=True, text=True, check=True).stdout)
        data = set(source.data_blocks())
        for e in extents:
            blocks = range(e["start"] // BLOCK_SIZE, (e["start"] + e["length"]) // BLOCK_SIZE)
            assert all((i in data) == e["data"] for i in blocks), e
            assert e["zero"] == (not e["data"])
    want = raw_of(Path(child.local_path), b / "child.raw")
    with serve(remote_spec(source, b, children=[child]), b, sockdir, "child") as server:
        assert convert(server.uri, b / "out2.raw") == want
        r = qemu_io(server.uri, "read -P 0x5a 1M 64k", "read -P 0 2M 64k")
        assert r.returncode == 0 and "Pattern verification failed" not in r.stdout, r.stdout + r.stderr


def test_qemu_opens_the_export_as_the_backing_file_of_a_leaf(source, sockdir):
    b = host_b(source)
    with serve(remote_spec(source, b), b, sockdir) as server:
        leaf = b / "leaf.qcow2"
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", server.qemu_backing(),
                        str(leaf)], check=True)
        r = subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x11 0 4k", str(leaf)], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        assert convert_qcow2(leaf, b / "leaf.raw")[4096:] == source.ref[4096:]


def convert_qcow2(path: Path, out: Path) -> bytes:
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(path), str(out)], check=True)
    return out.read_bytes()


def test_random_4k_reads_amplification_second_pass_and_restart(source, sockdir):
    b = host_b(source)
    rng = random.Random(3)
    picks = [rng.choice(source.data_blocks()) for _ in range(200)]
    cmds = [f"read {i * BLOCK_SIZE} 4k" for i in picks]
    spec = remote_spec(source, b)
    server = serve(spec, b, sockdir)
    try:
        r = qemu_io(server.uri, *cmds)
        assert r.returncode == 0 and "failed" not in r.stdout + r.stderr, r.stdout + r.stderr
        s1 = stats_after(server, len(picks))
        assert s1["guest_bytes"] == len(picks) * BLOCK_SIZE
        assert s1["source_bytes"] / s1["guest_bytes"] <= 1.1, s1
        assert s1["source_blocks"] > 0
        r = qemu_io(server.uri, *cmds)  # second pass: from the shadow
        assert r.returncode == 0
        s2 = stats_after(server, 2 * len(picks))
        assert s2["source_blocks"] == s1["source_blocks"] and s2["fetch_requests"] == s1["fetch_requests"]
    finally:
        server.stop()
    final = server.stats()
    assert final["pending_blocks"] == 0 and final["persisted_blocks"] >= final["source_blocks"]
    with serve(spec, b, sockdir) as again:  # a new process, the same shadows
        r = qemu_io(again.uri, *cmds)
        assert r.returncode == 0
        s3 = stats_after(again, len(picks))
        assert s3["source_blocks"] == 0 and s3["fetch_requests"] == 0 and s3["shadow_blocks"] == len(picks)


def test_a_wrong_block_fails_the_read_and_is_logged(source, lying_source, sockdir):
    url, victim = lying_source
    b = host_b(source)
    with serve(remote_spec(source, b, url=url), b, sockdir) as server:
        r = qemu_io(server.uri, f"read {victim * BLOCK_SIZE} 4k")
        assert "read failed" in r.stdout + r.stderr and "Input/output error" in r.stdout + r.stderr
        good = source.data_blocks()[40]
        r = qemu_io(server.uri, f"read {good * BLOCK_SIZE} 4k")
        assert r.returncode == 0 and "failed" not in r.stdout + r.stderr
        time.sleep(0.3)
        log = server.log_tail(50)
        assert f"layer {source.layer}: block {victim} " in log and "does not match its manifest hash" in log
    with Shadow(b / "shadows" / source.layer, source.manifest.block_count) as sh:
        assert not sh.has(victim) and sh.has(good)


def test_source_down_pauses_reads_of_missing_blocks_only(source, sockdir):
    b = host_b(source)
    data = source.data_blocks()
    cached, uncached = data[2], data[500]
    spec = remote_spec(source, b, retry=RetrySpec(seconds=1.0, initial_delay=0.05, max_delay=0.25))
    with serve(spec, b, sockdir) as server:
        assert qemu_io(server.uri, f"read {cached * BLOCK_SIZE} 4k").returncode == 0
        source.agent.stop()
        t0 = time.monotonic()
        r = qemu_io(server.uri, f"read {uncached * BLOCK_SIZE} 4k")
        assert "Input/output error" in r.stdout + r.stderr
        assert time.monotonic() - t0 >= 0.9
        r = qemu_io(server.uri, f"read -P 0x{block_of_source(source, cached)[0]:02x} {cached * BLOCK_SIZE} 1")
        assert r.returncode == 0 and "failed" not in r.stdout + r.stderr
        assert "unreachable" in server.log_tail(30)
        source.restart_agent()
        r = qemu_io(server.uri, f"read {uncached * BLOCK_SIZE} 4k")
        assert r.returncode == 0 and "failed" not in r.stdout + r.stderr
        with NbdClient(str(server.socket_path)) as nbd:
            assert nbd.pread(uncached * BLOCK_SIZE, BLOCK_SIZE) == block_of_source(source, uncached)


def test_killed_server_leaves_only_correct_blocks_and_resumes(source, sockdir):
    b = host_b(source)
    spec = remote_spec(source, b, readahead=ReadaheadSpec(0, 0))  # one fetch per read: slow on purpose
    server = serve(spec, b, sockdir)
    data = sorted(source.data_blocks())
    stop = threading.Event()

    def read_all() -> None:
        try:
            with NbdClient(str(server.socket_path)) as nbd:
                for i in data:
                    if stop.is_set():
                        return
                    nbd.pread(i * BLOCK_SIZE, BLOCK_SIZE)
        except OSError:
            pass  # the server was killed under us

    reader = threading.Thread(target=read_all)
    reader.start()
    nblocks = source.manifest.block_count

    def some_persisted() -> bool:
        if not (b / "shadows" / f"{source.layer}.bitmap").exists():
            return False
        with Shadow(b / "shadows" / source.layer, nblocks) as sh:
            return sh.present_count() > 100

    try:
        wait_until(some_persisted, 60, "100 blocks persisted in the shadow", interval=0.01)
        server.kill()  # SIGKILL: no clean-up, fetches in flight and blocks not yet persisted are lost
    finally:
        stop.set()
        reader.join(30)
    with Shadow(b / "shadows" / source.layer, nblocks) as sh:
        present = [i for i in data if sh.has(i)]
        assert 100 <= len(present) < len(data)
        for i in present:
            assert sh.read(i) == block_of_source(source, i), f"block {i} is marked present but wrong"
    with serve(spec, b, sockdir) as again:
        assert convert(again.uri, b / "out.raw") == source.ref
        s = stats_after(again, 1)
        assert s["shadow_blocks"] >= len(present)


def test_nbd_cache_requests_fetch_ahead_of_reads(source, sockdir):
    b = host_b(source)
    with serve(remote_spec(source, b), b, sockdir) as server:
        with NbdClient(str(server.socket_path)) as nbd:
            nbd.cache(0, 8 << 20)
        source.agent.stop()
        with NbdClient(str(server.socket_path)) as nbd:
            assert nbd.pread(0, 8 << 20) == source.ref[:8 << 20]


def test_prefetch_command_then_the_source_can_go(source, sockdir):
    b = host_b(source)
    spec = remote_spec(source, b)
    spec.save(b / "disk.json")
    r = subprocess.run([sys.executable, "-m", "diskserver", "prefetch", str(b / "disk.json"), "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["complete"] and report["blocks"] == len(source.data_blocks())
    source.agent.stop()
    r = subprocess.run([sys.executable, "-m", "diskserver", "status", str(b / "disk.json"), "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["complete"]
    with serve(replace(spec, retry=RetrySpec(seconds=0.2)), b, sockdir) as server:
        assert convert(server.uri, b / "out.raw") == source.ref


def test_background_prefetch_inside_the_server(source, sockdir):
    b = host_b(source)
    with serve(remote_spec(source, b, prefetch=True, prefetch_batch_blocks=64), b, sockdir) as server:
        s = wait_until(lambda: (st := server.stats()) and st["complete"] and st, 60, "the prefetch to complete",
                       interval=0.1)
        assert s["prefetch_blocks"] == len(source.data_blocks())
        source.agent.stop()
        assert convert(server.uri, b / "out.raw") == source.ref


def test_background_prefetch_pauses_while_the_source_is_away_and_resumes(source, sockdir):
    """A source out of reach for longer than its retry window pauses the server's prefetch; once it is back the
    prefetch resumes and completes (before, it stopped for good and the layer was never localized)."""
    b = host_b(source)
    source.agent.stop()
    spec = remote_spec(source, b, prefetch=True, prefetch_batch_blocks=64,
                       retry=RetrySpec(seconds=0.3, initial_delay=0.05, max_delay=0.1, request_timeout=2.0))
    with serve(spec, b, sockdir) as server:
        wait_until(lambda: "prefetch paused" in server.log_tail(50), 30, "the prefetch to pause", interval=0.1)
        assert not (server.stats() or {}).get("complete")
        source.restart_agent()
        s = wait_until(lambda: (st := server.stats()) and st["complete"] and st, 60,
                       "the prefetch to resume and complete", interval=0.2)
        assert s["prefetch_blocks"] == len(source.data_blocks())
        assert "prefetch stopped" not in server.log_tail(200)
        source.agent.stop()
        assert convert(server.uri, b / "out.raw") == source.ref


def test_start_failures_are_reported_with_the_log(source, sockdir, tmp_path):
    b = host_b(source)
    spec = remote_spec(source, b)
    bad = replace(spec, layers=(replace(spec.layers[0], manifest_path=str(b / "missing.manifest")),))
    with pytest.raises(ServerError, match="missing.manifest"):
        serve(bad, b, sockdir, "bad")
    assert not (sockdir / "bad.sock").exists()
    with pytest.raises(ServerError, match="longer than"):
        DiskServer(b / "x.json", "/tmp/" + "s" * 120, b / "x.log")


def test_servers_are_managed_through_their_pid_file(source, sockdir):
    b = host_b(source)
    spec = remote_spec(source, b)
    spec.save(b / "disk.json")
    server = DiskServer(b / "disk.json", sockdir / "d.sock", b / "d.log", exit_with_parent=False).start()
    try:
        handle = DiskServer.attach(b / "disk.json", sockdir / "d.sock", b / "d.log")
        assert handle.alive() and handle.pid == server.pid
        with pytest.raises(ServerError, match="already running"):
            DiskServer(b / "disk.json", sockdir / "d.sock", b / "d.log").start()
        handle.stop()
        assert not handle.alive() and not (sockdir / "d.sock").exists()
        # nbdkit is gone; the waiting shell it ran under (this process's child) exits right after it
        wait_until(lambda: not server.alive(), 10, "the starter's waiting shell to exit after nbdkit")
    finally:
        server.stop()


def test_plugin_finds_the_virtualenv_by_itself(source, sockdir):
    """Without CAPSULE_SITE_PACKAGES the plugin falls back to <repo>/.venv (nbdkit embeds the system python)."""
    b = host_b(source)
    remote_spec(source, b).save(b / "disk.json")
    sock = sockdir / "plain.sock"
    env = {k: v for k, v in os.environ.items() if k not in ("CAPSULE_SITE_PACKAGES", "PYTHONPATH", "VIRTUAL_ENV")}
    with open(b / "plain.log", "wb") as log:
        proc = subprocess.Popen(["nbdkit", "--foreground", "--readonly", "--exit-with-parent", "--unix", str(sock),
                                 "python", str(PLUGIN), f"spec={b / 'disk.json'}"], env=env, stdout=log, stderr=log,
                                cwd="/")
    try:

        def answering() -> bool:
            assert proc.poll() is None, (b / "plain.log").read_text()
            return sock.exists() and probe(str(sock))

        wait_until(answering, 30, f"nbdkit to answer on {sock}")
        i = source.data_blocks()[7]
        with NbdClient(str(sock)) as nbd:
            assert nbd.size == len(source.ref)
            assert nbd.pread(i * BLOCK_SIZE, BLOCK_SIZE) == source.ref[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
    finally:
        proc.terminate()
        proc.wait(10)


STARTER = """
import sys
from diskserver.server import DiskServer
DiskServer(sys.argv[1], sys.argv[2], sys.argv[3]).start()
print("started", flush=True)
"""


def test_a_server_outlives_the_process_that_started_it(source, sockdir):
    """`capsule run` starts the disk server and exits; the guest keeps reading from it. (nbdkit in the
    foreground dies with its parent unless something keeps that parent alive.)"""
    b = host_b(source)
    spec = remote_spec(source, b)
    spec.save(b / "disk.json")
    starter = subprocess.run([sys.executable, "-c", STARTER, str(b / "disk.json"), str(sockdir / "d.sock"),
                              str(b / "d.log")], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert starter.returncode == 0 and "started" in starter.stdout, starter.stderr
    handle = DiskServer.attach(b / "disk.json", sockdir / "d.sock", b / "d.log")
    try:
        time.sleep(1.0)  # a parent-death signal would have ended it by now
        assert handle.alive(), handle.log_tail()
        assert probe(str(sockdir / "d.sock"), timeout=5.0)
        assert convert(handle.uri, b / "out.raw") == source.ref  # every block, fetched from the source
    finally:
        handle.stop()
    assert not handle.alive() and not (sockdir / "d.sock").exists()
