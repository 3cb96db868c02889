"""The capsule repository against a real SeaweedFS cluster on loopback (a master, two volume servers, a filer
and its S3 gateway): init, push two capsules sharing an image (the second uploads only its new blocks),
restore byte-identical into a store that never held them, nothing readable in the bucket, forget and prune,
check naming a deleted or damaged pack and the versions that use it, a wrong passphrase refused."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from capsule import capsules
from capsule.errors import AuthFailed, Conflict, Error
from capsule.repo import maintain
from capsule.repo.format import PACK2_MAGIC, pack_name
from capsule.repo.push import push
from capsule.repo.repository import Repository
from capsule.repo.restore import restore
from capsule.repo.s3 import Credentials, S3Client, parse_url
from capsule.store.catalogue import VersionRow
from capsule.store.objectio import BlockReader
from capsule.verify import verify
from testkit.fleetkit import with_memory
from testkit.images import make_store
from testkit.seaweedfs import ROOT, SeaweedCluster, port_pair
from tests.wait import wait_until

pytestmark = [pytest.mark.tools, pytest.mark.timeout(300)]

PASS = b"correct horse battery staple"
MEMORY_BLOCKS = 1024                       # a 4 MiB memory image
CHANGED = 8                                # blocks the second capsule's memory differs in
SECRET_BLOCK = random.Random(27).randbytes(4096)   # incompressible: found in the bucket only if in clear


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    cluster = SeaweedCluster(tmp_path_factory.mktemp("seaweedfs"))
    cluster.start()
    yield cluster
    cluster.remove()


def _client(seaweed, bucket: str, prefix: str = "repo") -> S3Client:
    return S3Client(parse_url(seaweed.url(bucket, prefix)), Credentials(seaweed.access_key, seaweed.secret_key))


def _memories():
    rng = random.Random(1)
    blocks = [rng.randbytes(4096) for _ in range(MEMORY_BLOCKS)]
    blocks[5] = SECRET_BLOCK
    first = b"".join(blocks)
    for i in range(100, 100 + CHANGED):
        blocks[i] = rng.randbytes(4096)
    return first, b"".join(blocks)


@pytest.fixture
def stores(tmp_path, tiny_images):
    """Host A holds capsules one and two on the tiny image, their memory images 8 blocks apart; host B is
    empty (not even the image)."""
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images)
    capsules.create(a, "one", "tiny", memory="256M")
    capsules.create(a, "two", "tiny", memory="256M")
    m1, m2 = _memories()
    refs = with_memory(a, "one", m1), with_memory(a, "two", m2)
    yield a, b, refs
    a.close()
    b.close()


def test_second_capsule_uploads_only_new_blocks_and_restores_byte_identical(seaweed, stores):
    a, b, (one, two) = stores
    repo = Repository.init(_client(seaweed, "dedup"), PASS)
    first = push(a, one, repo)
    assert first.objects == 4 and first.objects_present == 0 and first.blocks_new > MEMORY_BLOCKS
    assert first.blocks_new + first.blocks_known == first.blocks     # repeats within one push: sent once
    second = push(a, two, repo)
    # its layer, kernel and initrd are one's: only its memory image is read, and only 8 blocks are new
    assert second.objects_present == 3 and second.blocks == MEMORY_BLOCKS
    assert second.blocks_new == CHANGED and second.blocks_known == MEMORY_BLOCKS - CHANGED
    assert second.uploaded_bytes < CHANGED * 4096 + 200_000 < first.uploaded_bytes / 10
    print(f"\nfirst push {first.uploaded_bytes} B uploaded ({first.blocks_new} blocks, {first.seconds}s); "
          f"second {second.uploaded_bytes} B ({second.blocks_new} blocks, {second.seconds}s)")

    opened = Repository.open(_client(seaweed, "dedup"), PASS)     # another host: only the passphrase
    got = restore(b, two, opened)
    assert got.recorded and len(got.installed) == 4
    va, vb = a.catalogue.latest_version("two"), b.catalogue.latest_version("two")
    assert vb.chains == va.chains and vb.memory == va.memory
    assert b.file_path(vb.memory).read_bytes() == a.file_path(va.memory).read_bytes()
    layer = vb.chains[0][0]     # a layer is rebuilt as qcow2 (as a pull does): its guest blocks are identical
    indices = list(a.layer_manifest(layer).indices())
    with BlockReader(a, "layer", layer) as ra, BlockReader(b, "layer", layer) as rb:
        assert indices and rb.read(indices) == ra.read(indices)
    assert verify(b).ok
    again = restore(b, two, opened)
    assert again.installed == [] and again.objects_present == 4 and again.downloaded_bytes == 0


def test_nothing_in_the_bucket_is_readable(seaweed, stores):
    a, _b, (one, _two) = stores
    repo = Repository.init(_client(seaweed, "clear"), PASS)
    push(a, one, repo)
    v = a.catalogue.latest_version("one")
    # no needle shorter than 6 bytes: a 4-byte one ("one@") turns up by chance in a few MiB of ciphertext
    # (about once in 2^32 positions), which failed this test once without any plaintext there
    needles = [SECRET_BLOCK[:64], SECRET_BLOCK[2000:2064], v.memory.encode(), v.chains[0][0].encode(),
               bytes.fromhex(v.memory), b'"capsule"', b'"capsule": "one"', b"one@" + str(v.number).encode() + b'"']
    raw = _client(seaweed, "clear", "")
    names = [k for k, _ in raw.list("repo/")]
    assert any(k.startswith("repo/packs/") for k in names) and any(k.startswith("repo/versions/") for k in names)
    for key in names:
        body = raw.get(key)
        assert not any(n in body for n in needles), f"{key} holds plaintext"


@pytest.mark.parametrize("fmt", [1, 2])
def test_forget_prune_and_check_name_bad_packs(seaweed, stores, fmt):
    a, b, (one, two) = stores
    bucket = f"prune{fmt}"
    url = seaweed.url(bucket, "repo")
    repo = Repository.init(_client(seaweed, bucket), PASS, fmt=fmt)
    push(a, one, repo)
    push(a, two, repo)
    before = maintain.stats(repo)
    maintain.forget(repo, one)
    pruned = maintain.prune(repo)
    after = maintain.stats(repo)
    if fmt == 1:    # one's 8 blocks that two does not share are gone: their pack was repacked without them
        assert pruned["packs_repacked"] >= 1 and after["blocks"] == before["blocks"] - CHANGED
    else:           # they share a blob of 16 with 8 blocks two uses: a blob is kept whole while one is used
        assert pruned["packs_repacked"] == 0 and after["blocks"] == before["blocks"]
    assert after["versions"] == 1 and maintain.check(repo, read_data=True).ok
    assert restore(b, two, repo).recorded

    index, _ = repo.load_index()
    packs = sorted({e.pack for e in index.values()})
    raw = _client(seaweed, bucket, "")
    damaged = raw.get(f"repo/{pack_name(packs[0])}")
    flipped = bytearray(damaged)
    flipped[100] ^= 0x01
    raw.put(f"repo/{pack_name(packs[0])}", bytes(flipped))
    raw.delete(f"repo/{pack_name(packs[1])}")

    env = dict(os.environ, **seaweed.env(), CAPSULE_REPO_PASSPHRASE=PASS.decode(), CAPSULE_HOME=str(a.home))
    cli = [sys.executable, "-m", "capsule.cli.main"]
    quick = subprocess.run([*cli, "repo", "check", url, "--json"], capture_output=True, text=True, env=env,
                           timeout=120)
    assert quick.returncode == 6, quick.stderr
    report = json.loads(quick.stdout)
    assert list(report["bad_packs"]) == [packs[1]] and report["bad_packs"][packs[1]] == [two]
    full = subprocess.run([*cli, "repo", "check", url, "--read-data", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert full.returncode == 6
    report = json.loads(full.stdout)
    assert sorted(report["bad_packs"]) == sorted(packs[:2])
    assert any(packs[0] in e and "damaged" in e and two in e for e in report["errors"])


def test_a_format_1_repository_upgraded_keeps_its_packs_and_stores_new_blocks_in_groups(seaweed, stores):
    a, b, (one, two) = stores
    url = seaweed.url("upgrade", "repo")
    repo = Repository.init(_client(seaweed, "upgrade"), PASS, fmt=1)
    first = push(a, one, repo)
    raw = _client(seaweed, "upgrade", "")
    old = {k: raw.get(k) for k, _ in raw.list("repo/packs/")}
    assert old and not any(body.endswith(PACK2_MAGIC) for body in old.values())

    env = dict(os.environ, **seaweed.env(), CAPSULE_REPO_PASSPHRASE=PASS.decode(), CAPSULE_HOME=str(a.home))
    cli = [sys.executable, "-m", "capsule.cli.main", "repo", "upgrade", url, "--json"]
    done = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"url": url, "format": 2, "from": 1, "upgraded": True}
    repo = Repository.open(_client(seaweed, "upgrade"), PASS)
    second = push(a, two, repo)
    assert second.blocks_new == CHANGED
    new = {k: raw.get(k) for k, _ in raw.list("repo/packs/") if k not in old}
    assert len(new) == 1 and next(iter(new.values())).endswith(PACK2_MAGIC)
    assert {k: raw.get(k) for k in old} == old                    # nothing stored was rewritten
    assert maintain.check(repo, read_data=True).ok and maintain.stats(repo)["format"] == 2

    got = restore(b, two, repo)                   # blocks from both kinds of pack
    va, vb = a.catalogue.latest_version("two"), b.catalogue.latest_version("two")
    assert got.recorded and b.file_path(vb.memory).read_bytes() == a.file_path(va.memory).read_bytes()
    maintain.forget(repo, two)
    maintain.prune(repo)
    assert maintain.check(repo, read_data=True).ok and len(repo.load_index()[0]) == first.blocks_new

    fresh = push(a, one, Repository.init(_client(seaweed, "upgrade2"), PASS))
    print(f"\n{one} stored in format 1: {first.uploaded_bytes} B; in format 2: {fresh.uploaded_bytes} B")
    assert fresh.blocks_new == first.blocks_new and fresh.uploaded_bytes < first.uploaded_bytes


def test_cli_init_push_keys_and_wrong_passphrase(seaweed, stores, tmp_path):
    a, _b, (one, _two) = stores
    url = seaweed.url("cli", "lab")
    env = dict(os.environ, **seaweed.env(), CAPSULE_REPO_PASSPHRASE="first secret", CAPSULE_HOME=str(a.home))
    cli = [sys.executable, "-m", "capsule.cli.main"]

    def run(*args, **extra):
        return subprocess.run([*cli, *args], capture_output=True, text=True, env=dict(env, **extra), timeout=120)

    assert run("repo", "init", url, "--json").returncode == 0
    again = run("repo", "init", url)
    assert again.returncode == 4 and "holds a repository already" in again.stderr
    pushed = run("repo", "push", one, url, "--json")
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["blocks_new"] > MEMORY_BLOCKS
    listed = json.loads(run("repo", "ls", url, "--json").stdout)
    assert [r["version"] for r in listed] == [one]

    wrong = run("repo", "ls", url, CAPSULE_REPO_PASSPHRASE="not it")
    assert wrong.returncode == 11 and "wrong passphrase" in wrong.stderr

    key_file = tmp_path / "repo.key"
    key_file.write_bytes(os.urandom(32))
    added = run("repo", "key", "add", url, "--new-key-file", str(key_file), "--json")
    assert added.returncode == 0, added.stderr
    new_id = json.loads(added.stdout)["id"]
    keys = json.loads(run("repo", "key", "ls", url, "--key-file", str(key_file), "--json").stdout)
    assert len(keys) == 2 and [k["id"] for k in keys if k["current"]] == [new_id]
    old_id = next(k["id"] for k in keys if not k["current"])
    self_rm = run("repo", "key", "rm", url, new_id, "--key-file", str(key_file))
    assert self_rm.returncode == 5
    assert run("repo", "key", "rm", url, old_id, "--key-file", str(key_file)).returncode == 0
    gone = run("repo", "ls", url)                     # the first passphrase no longer opens it
    assert gone.returncode == 11
    with pytest.raises(AuthFailed):
        Repository.open(_client(seaweed, "cli", "lab"), b"first secret")
    stats = json.loads(run("repo", "stats", url, "--key-file", str(key_file), "--json").stdout)
    assert stats["versions"] == 1 and stats["keys"] == 1

    restored = run("repo", "restore", one, url, "--key-file", str(key_file), "--json", CAPSULE_HOME=str(_b.home))
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["recorded"] and _b.catalogue.latest_version("one").number == 2
    absent = run("repo", "restore", "nobody@1", url, "--key-file", str(key_file), CAPSULE_HOME=str(_b.home))
    assert absent.returncode == 3 and "holds no nobody@1" in absent.stderr


def test_a_push_cut_by_a_killed_s3_gateway_shows_nothing_and_resumes(seaweed, stores, monkeypatch):
    a, b, (one, _two) = stores
    monkeypatch.setattr(Repository, "pack_size", property(lambda self: 1024 * 1024))   # several packs
    repo = Repository.init(_client(seaweed, "killed"), PASS)
    stored = []
    put = repo.client.put

    def kill_after_two_packs(key: str, data: bytes) -> None:   # packs are PUT in the background, two at once
        put(key, data)
        if "/packs/" in f"/{key}":
            stored.append(key)
            if len(stored) == 2:
                seaweed.kill("s3")

    monkeypatch.setattr(repo.client, "put", kill_after_two_packs)
    try:
        with pytest.raises(Error):
            push(a, one, repo)
    finally:
        if "s3" not in seaweed.roles:
            seaweed.restart("s3")
    monkeypatch.undo()
    assert maintain.listing(repo) == []                  # no version record: nothing half-written is visible
    full = sum(1 for _ in repo.names("packs"))
    assert full >= 2          # the two, and one PUT under way beside the second may have ended before the kill
    resumed = push(a, one, repo)
    assert resumed.packs_adopted == full and resumed.blocks_new + resumed.blocks_known == resumed.blocks
    assert resumed.blocks_known >= full * 200     # the packs' blocks (1 MiB each) were not sent again
    assert [r["version"] for r in maintain.listing(repo)] == [one]
    assert maintain.check(repo, read_data=True).ok
    assert restore(b, one, repo).recorded


def test_two_hosts_push_at_once_and_prune_waits_for_them(seaweed, stores, tmp_path, tiny_images):
    a, b, (one, two) = stores
    Repository.init(_client(seaweed, "together"), PASS)
    host_a, host_b = (Repository.open(_client(seaweed, "together"), PASS) for _ in range(2))
    refused = []

    def prune_beside(msg: str) -> None:
        if "pack(s)" in msg and not refused:
            with pytest.raises(Conflict, match="locked by") as info:
                maintain.prune(Repository.open(_client(seaweed, "together"), PASS))
            refused.append(str(info.value))

    import threading

    results = {}
    threads = [threading.Thread(target=lambda r=r, ref=ref, say=say: results.setdefault(ref, push(a, ref, r, say)))
               for r, ref, say in ((host_a, one, prune_beside), (host_b, two, lambda _m: None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(results) == {one, two} and refused
    assert sorted(r["version"] for r in maintain.listing(host_a)) == [one, two]
    assert maintain.check(host_a, read_data=True).ok
    pruned = maintain.prune(host_a)       # alone now: duplicate blocks the two pushes both sent are repacked
    assert maintain.check(host_a, read_data=True).ok
    assert restore(b, two, host_a).recorded and restore(b, one, host_a).recorded
    print(f"\nconcurrent pushes: {pruned}")


def _pid_of(workdir, role: str) -> int:
    """The pid of the SeaweedFS server ``role`` (``volume0`` …) whose data is under ``workdir``."""
    for proc in os.listdir("/proc"):
        if proc.isdigit():
            try:
                with open(f"/proc/{proc}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if f"-dir={workdir / role}".encode() in args:
                return int(proc)
    raise AssertionError(f"no SeaweedFS {role} runs under {workdir}")


def test_the_compose_object_store_loses_a_volume_server_and_nothing_else(tmp_path_factory, stores):
    """The compose file's object store, as it runs there (``python -m testkit.seaweedfs serve``): replication
    "010", each volume also on the volume server of the other rack. One of its two volume servers killed: the
    service goes on, every pack still reads back and a version restores (with "000" the same loss fails the
    read)."""
    a, b, (one, _two) = stores
    work = tmp_path_factory.mktemp("seaweedfs-serve")
    port = port_pair()
    with open(work / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "testkit.seaweedfs", "serve", str(work), str(port)],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: (work / "ready").exists() or proc.poll() is not None, 240,
                   lambda: f"the object store to be ready: {(work / 'serve.log').read_text()[-2000:]}")
        assert proc.poll() is None, (work / "serve.log").read_text()
        keys = json.loads((work / "credentials.json").read_text())
        client = S3Client(parse_url(f"s3+http://127.0.0.1:{port}/replicated/repo"),
                          Credentials(keys["AWS_ACCESS_KEY_ID"], keys["AWS_SECRET_ACCESS_KEY"]), timeout=30)
        repo = Repository.init(client, PASS)
        push(a, one, repo)
        os.kill(_pid_of(work, "volume0"), signal.SIGKILL)
        wait_until(lambda: "volume0 exited" in (work / "serve.log").read_text(), 30,
                   "the service to notice its lost volume server")
        assert proc.poll() is None                          # the service goes on, degraded
        assert maintain.check(repo, read_data=True).ok
        assert restore(b, one, repo).recorded
    finally:
        proc.terminate()
        proc.wait(60)


def test_scheduled_backups_copy_to_a_repository_keep_its_policy_and_verify(seaweed, stores, monkeypatch):
    """`backup schedule NAME --to s3://…`: each run's backups are pushed to the repository, its --to-keep
    policy forgets and prunes there, and `backup verify` checks the repository, naming a lost pack."""
    from capsule.backup import jobs, runner, verifyjob
    from capsule.backup.retention import Policy

    a, _b, (one, _two) = stores
    url = seaweed.url("scheduled", "lab")
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CAPSULE_REPO_PASSPHRASE", PASS.decode())
    Repository.init(_client(seaweed, "scheduled", "lab"), PASS)
    jobs.schedule(a, "one", "daily", Policy(last=5), target=url, target_policy=Policy(last=1))
    clock = [time.time()]

    def take(store, name, mode, say):      # a snapshot without a guest: a backup version of the same objects
        v = store.catalogue.latest_version(name)
        row = VersionRow(name, v.number + 1, name, v.number, v.memory, v.chains, v.config,
                         jobs.backup_note(mode, "memory"), clock[0])
        store.catalogue.add_version(row)
        return runner.Taken(row, 0, 0.0, "memory")

    first = runner.run(a, "one", take=take, clock=lambda: clock[0])
    assert first.ok, first.error
    assert first.copy.copied == [3] and first.copy.wire_bytes > 1_000_000
    clock[0] += 86400
    second = runner.run(a, "one", take=take, clock=lambda: clock[0])
    assert second.ok, second.error
    assert second.copy.copied == [4] and second.copy.wire_bytes < 100_000     # nothing new but its record
    assert second.copy.pruned == [3]                                            # --to-keep last=1
    repo = Repository.open(_client(seaweed, "scheduled", "lab"), PASS)
    assert [r["version"] for r in maintain.listing(repo)] == ["one@4"]

    checked = verifyjob.run(a, ["one"])
    there = next(h for h in checked.hosts if h.host == url)
    assert there.error is None and there.broken == [] and there.backups == ["one@4"]
    index, _ = repo.load_index()
    lost = next(iter({e.pack for e in index.values()}))
    _client(seaweed, "scheduled", "").delete(f"lab/{pack_name(lost)}")
    checked = verifyjob.run(a, ["one"])
    there = next(h for h in checked.hosts if h.host == url)
    assert [(b.kind, b.id, b.backups) for b in there.broken] == [("pack", lost, ["one@4"])]


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_a_crashed_prunes_lock_is_passed_over_here_and_unlock_removes_dead_writers_locks(seaweed, stores):
    """A prune killed on this host leaves its exclusive lock: a push passes over it at once (its process is
    gone; before, every push was refused for half an hour). A live prune's lock on another host still refuses a
    push. `repo unlock` removes only dead writers' locks; `--remove-all` removes that one too."""
    import socket

    a, _b, (one, _two) = stores
    url = seaweed.url("unlock", "lab")
    Repository.init(_client(seaweed, "unlock", "lab"), PASS)
    repo = Repository.open(_client(seaweed, "unlock", "lab"), PASS)
    crashed = {"exclusive": True, "host": socket.gethostname(), "pid": _dead_pid(), "time": time.time()}
    repo.put_json("locks/" + "c" * 32, crashed)
    assert push(a, one, repo).blocks_new > 0                       # passed over: its writer is gone
    elsewhere = {"exclusive": True, "host": "another-host", "pid": os.getpid(), "time": time.time()}
    repo.put_json("locks/" + "e" * 32, elsewhere)
    repo.put_json("locks/" + "c" * 32, crashed)
    with pytest.raises(Conflict, match="locked by another-host"):
        push(a, one, repo)

    env = dict(os.environ, **seaweed.env(), CAPSULE_REPO_PASSPHRASE=PASS.decode(), CAPSULE_HOME=str(a.home))

    def unlock(*args: str) -> list[dict]:
        proc = subprocess.run([sys.executable, "-m", "capsule.cli.main", "--json", "repo", "unlock", url, *args],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["removed"]

    assert [r["lock"] for r in unlock()] == ["locks/" + "c" * 32]     # the dead one only
    assert [n for n, _ in repo.names("locks")] == ["locks/" + "e" * 32]
    assert [r["host"] for r in unlock("--remove-all")] == ["another-host"]
    assert list(repo.names("locks")) == []
    assert push(a, one, repo).objects_present == 4                  # free again
