"""Instant restore from a capsule repository, with no guest: a version pushed from host A into a real SeaweedFS
cluster is made ready on host B (which never held it) with its disk layer paged in by a real disk server
(nbdkit) from the repository's packs, block-identical to A's; a prune that moved the blobs to other packs does
not break it; everything localizes and the repository's key leaves B; a store out of reach fails a read after
the retry window and its return heals it. The CLI's errors (unknown version,
wrong passphrase, unreachable store) change nothing on B."""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from capsule import capsules, watch
from capsule.lifecycle import demand
from capsule.repo import instant
from capsule.repo.format import PackWriter, Place, blobs_of, encode_index, new_id, pack_name, read_pack_header
from capsule.repo.push import push
from capsule.repo.repository import Repository
from capsule.repo.s3 import Credentials, S3Client, parse_url
from capsule.verify import verify
from diskserver import DiskServer
from diskserver.chain import Chain, RetrySpec
from diskserver.errors import SourceUnavailable
from diskserver.nbdclient import NbdClient
from testkit.fleetkit import with_memory
from testkit.images import make_store
from testkit.seaweedfs import SeaweedCluster

pytestmark = [pytest.mark.tools, pytest.mark.timeout(300)]

PASS = b"instant restore passphrase"


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    cluster = SeaweedCluster(tmp_path_factory.mktemp("seaweedfs"))
    cluster.start()
    yield cluster
    cluster.remove()


def _client(seaweed, bucket: str) -> S3Client:
    return S3Client(parse_url(seaweed.url(bucket, "repo")), Credentials(seaweed.access_key, seaweed.secret_key))


@pytest.fixture
def pushed(seaweed, tmp_path, tiny_images):
    """Host A's capsule ``one`` pushed into a fresh repository; host B empty (not even the image)."""
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images)
    capsules.create(a, "one", "tiny", memory="256M")
    ref = with_memory(a, "one", random.Random(27).randbytes(1 << 20))
    bucket = f"instant-{new_id()[:8]}"
    push(a, ref, Repository.init(_client(seaweed, bucket), PASS))
    yield a, b, ref, bucket
    a.close()
    b.close()


def _raw(path: Path, out: Path) -> bytes:
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(path), str(out)], check=True)
    return out.read_bytes()


@pytest.fixture
def sockdir():
    """A short directory for the disk server's socket (a unix socket's path is at most 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="ri-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _serve(store, chain: list[str], d: Path, *, prefetch: bool = False) -> DiskServer:
    spec = demand.chain_spec(store, chain, "ri-disk0")
    spec.save(d / "disk0.spec.json")
    return DiskServer(d / "disk0.spec.json", d / "disk0.nbd", d / "disk0.log", exit_with_parent=True,
                      prefetch=prefetch).start()


def _stats(store) -> dict:
    return json.loads((demand.shadow_dir(store) / "ri-disk0.stats.json").read_text())


def _repack(repo: Repository) -> None:
    """What a prune does to a partly used pack: its blobs copied, still sealed, into a new pack, one new index
    replacing the old ones, then the old packs deleted."""
    index, names = repo.load_index()
    new: dict[str, dict[bytes, Place]] = {}
    for pack in sorted({e.pack for e in index.values()}):
        data = repo.client.get(repo.location.key(pack_name(pack)))
        writer = PackWriter(repo.key)
        for (off, n), members in blobs_of(read_pack_header(repo.key, pack, data)).items():
            writer.add_sealed(members, data[off:off + n])
        repo.client.put(repo.location.key(pack_name(writer.id)), writer.finish())
        new[writer.id] = writer.entries
    repo.put_sealed(f"index/{new_id()}", encode_index(new))
    for name in names:
        repo.client.delete(repo.location.key(name))
    for pack in {e.pack for e in index.values()}:
        repo.client.delete(repo.location.key(pack_name(pack)))


def test_a_layer_pages_in_from_the_repository_then_localizes(seaweed, pushed, tmp_path, sockdir):
    a, b, ref, bucket = pushed
    version = a.catalogue.latest_version("one")
    chain = version.chains[0]
    want = _raw(a.layer_path(chain[-1]), tmp_path / "a.raw")

    report = instant.prepare(b, ref, Repository.open(_client(seaweed, bucket), PASS))
    assert report.recorded and report.remote_layers == chain
    files = [version.config["kernel"], version.config["initrd"], version.memory]
    assert sorted(report.restored) == sorted(files)                  # kernel, initrd and memory image, whole
    assert b.file_path(version.memory).read_bytes() == a.file_path(version.memory).read_bytes()
    whole = sum(a.file_path(f).stat().st_size for f in files)
    assert report.downloaded_bytes < whole + (1 << 20)               # and no disk block yet
    assert b.catalogue.latest_version("one").chains[0] == chain
    assert all(demand.is_remote(b, lid) for lid in chain)
    secret = demand.token_path(b, report.url)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert PASS not in secret.read_bytes()                          # the master key is there, never the passphrase

    server = _serve(b, chain, sockdir)
    try:
        with NbdClient(str(server.socket_path)) as nbd:
            assert nbd.pread(0, 1 << 20) == want[:1 << 20]
            middle = (len(want) // 2) & ~4095
            assert nbd.pread(middle, 256 << 10) == want[middle:middle + (256 << 10)]
    finally:
        server.stop()
    first = _stats(b)
    data_bytes = sum(demand.layer_progress(b, lid)[1] for lid in chain) * 4096
    assert first["fetch_errors"] == 0 and first["verify_failures"] == 0
    assert 0 < first["source_bytes"] < data_bytes / 2             # only what was read, and its read-ahead
    assert 0 < first["wire_bytes"] < first["source_bytes"] + 64 * 1024 * first["fetch_requests"]
    assert first["fetch_attempts"] * 16 <= first["source_blocks"]  # neighbouring blobs come in one ranged GET
    assert demand.localize(b) == []                                # not everything is here yet
    print(f"\n{first['guest_bytes']} B read through the disk server; {first['source_bytes']} B of blocks and "
          f"{first['wire_bytes']} B on the link, in {first['fetch_requests']} read(s) of {first['fetch_attempts']} "
          f"ranged GET(s), of {data_bytes} B of data")

    _repack(Repository.open(_client(seaweed, bucket), PASS))        # every pack the places name is gone
    server = _serve(b, chain, sockdir, prefetch=True)
    try:
        deadline = time.monotonic() + 120
        while any(demand.layer_progress(b, lid)[0] < demand.layer_progress(b, lid)[1] for lid in chain) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        with NbdClient(str(server.socket_path)) as nbd:
            assert nbd.pread(0, len(want)) == want
    finally:
        server.stop()
    assert _stats(b)["fetch_errors"] == 0
    assert demand.localize(b) == chain
    assert not any(demand.is_remote(b, lid) for lid in chain)
    assert not secret.exists()                                     # nothing reads from the repository: key gone
    assert not list(demand.remote_dir(b).glob("*.places"))
    assert _raw(b.layer_path(chain[-1]), tmp_path / "b.raw") == want
    assert verify(b).ok


def test_a_start_that_fails_takes_the_repository_key_away_again(seaweed, pushed, monkeypatch):
    from capsule import lifecycle
    from capsule.errors import RuntimeFailure

    _a, b, ref, bucket = pushed

    def fails(*_args, **_kw):
        raise RuntimeFailure("booting failed (simulated)")

    monkeypatch.setattr(lifecycle, "start", fails)
    with pytest.raises(RuntimeFailure, match="simulated"):
        instant.start(b, ref, Repository.open(_client(seaweed, bucket), PASS))
    url = parse_url(seaweed.url(bucket, "repo")).url
    assert b.catalogue.latest_version("one").ref == ref                # recorded, its layers remote …
    assert not demand.token_path(b, url).exists()                      # … but the key is not left behind


def test_a_backup_restored_live_that_fails_to_start_takes_the_repository_key_away_again(seaweed, pushed,
                                                                                      monkeypatch):
    """`backup restore --from REPO --live` (repo.backups.restore_from): the same guarantee as `start --from`."""
    from capsule import lifecycle
    from capsule.errors import RuntimeFailure
    from capsule.repo import backups as repo_backups

    _a, b, ref, bucket = pushed

    def fails(*_args, **_kw):
        raise RuntimeFailure("booting failed (simulated)")

    monkeypatch.setattr(lifecycle, "start", fails)
    with pytest.raises(RuntimeFailure, match="simulated"):
        repo_backups.restore_from(b, ref, Repository.open(_client(seaweed, bucket), PASS), live=True)
    url = parse_url(seaweed.url(bucket, "repo")).url
    latest = b.catalogue.latest_version("one")
    assert latest.note == f"restored from {ref}"                       # the backup became its latest version …
    assert all(demand.is_remote(b, lid) for lid in latest.chains[0])   # … on layers still in the repository
    assert not demand.token_path(b, url).exists()                      # … but the key is not left behind


def test_cli_errors_name_the_problem_and_change_nothing(seaweed, pushed):
    a, b, ref, bucket = pushed
    url = seaweed.url(bucket, "repo")
    env = dict(os.environ, **seaweed.env(), CAPSULE_REPO_PASSPHRASE=PASS.decode(), CAPSULE_HOME=str(b.home),
               COLUMNS="400")

    def start(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "capsule.cli.main", "start", *args], capture_output=True,
                              text=True, env=dict(env, **extra), timeout=120)

    absent = start("one@9", "--from", url, "--json")
    assert absent.returncode == 3 and "holds no one@9" in absent.stderr and absent.stdout == ""
    wrong = start(ref, "--from", url, CAPSULE_REPO_PASSPHRASE="not it")
    assert wrong.returncode == 11 and "wrong passphrase" in wrong.stderr
    gone = start(ref, "--from", "s3+http://127.0.0.1:9/nobucket/repo")
    assert gone.returncode == 12 and "cannot be reached" in gone.stderr
    mixed = start(ref, "--from", url, "--token-file", "/dev/null")
    assert mixed.returncode == 2 and "--key-file" in mixed.stderr
    alone = start(ref, "--key-file", "/dev/null")
    assert alone.returncode == 2 and "--from s3://" in alone.stderr
    assert b.catalogue.versions() == [] and not list(demand.remote_dir(b).iterdir())


def test_a_repository_out_of_reach_fails_a_read_clearly_and_its_return_heals(seaweed, pushed, tmp_path):
    """Blocks not yet here wait for the store for the retry window, then fail naming the repository (the guest
    would see EIO and pause, as with a peer); once it answers again the same read succeeds."""
    a, b, ref, bucket = pushed
    chain = a.catalogue.latest_version("one").chains[0]
    want = _raw(a.layer_path(chain[-1]), tmp_path / "a.raw")
    instant.prepare(b, ref, Repository.open(_client(seaweed, bucket), PASS))
    spec = replace(demand.chain_spec(b, chain, "ri-gone"), retry=RetrySpec(seconds=1.0, request_timeout=5.0))
    with Chain.open(spec, background=False) as disk:
        assert disk.read(0, 4096) == want[:4096]
        url = seaweed.url(bucket, "repo")
        assert watch.reachable([url])
        seaweed.kill("s3")
        try:
            t0 = time.monotonic()
            with pytest.raises(SourceUnavailable, match="the repository at s3\\+http://.* is unreachable"):
                disk.read(1 << 20, 65536)
            assert time.monotonic() - t0 < 30
            assert not watch.reachable([url])     # the watcher keeps the paused guest waiting …
        finally:
            seaweed.restart("s3")
        assert watch.reachable([url])             # … and resumes it once the store answers
        assert disk.read(1 << 20, 65536) == want[1 << 20:(1 << 20) + 65536]
        assert disk.stats()["fetch_errors"] >= 1
