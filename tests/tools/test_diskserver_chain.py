"""The disk server's chain, in process: two hosts on loopback — store A with the tiny image and a real
agent, and B holding only manifests, shadows and (sometimes) a local child layer."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from diskserver.chain import Chain, ChainSpec, LayerSpec, ReadaheadSpec, RemoteSpec, RetrySpec
from diskserver.errors import BlockMismatch, SourceUnavailable, SpecError
from hashcache.blocks import BLOCK_SIZE
from hashcache.cache import HashCache
from hashcache.manifest import Manifest, manifest_of_layer
from hashcache.qcow2 import Qcow2Image
from hashcache.shadow import Shadow
from testkit.images import make_store
from tests.conftest import Agent, free_port
from tests.wait import wait_until

pytestmark = pytest.mark.tools


# -- helpers shared with test_diskserver_server.py --------------------------------------------------------


class PortAgent(Agent):
    """``capsule serve`` on a chosen port (so a test can stop the source and start it again)."""

    def __init__(self, home: Path, token_file: Path, port: int) -> None:
        super().__init__(home, token_file, port)


@dataclass
class Source:
    """Host A: a store holding the tiny image (a capsule on its root layer) and its agent."""

    store: object
    layer: str  # the tiny root layer's id
    agent: PortAgent
    token_file: Path
    ref: bytes  # the flattened root layer, as qemu-img reads it
    tmp: Path

    @property
    def layer_path(self) -> Path:
        return self.store.layer_path(self.layer)  # type: ignore[attr-defined]

    @property
    def manifest(self) -> Manifest:
        return self.store.layer_manifest(self.layer)  # type: ignore[attr-defined]

    def data_blocks(self) -> list[int]:
        return [i for i, z, _h in self.manifest.records() if not z]

    def restart_agent(self) -> None:
        self.agent.stop()
        self.agent = PortAgent(self.agent.home, self.token_file, self.agent.port)


def raw_of(path: Path, out: Path) -> bytes:
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(path), str(out)], check=True)
    return out.read_bytes()


@pytest.fixture
def source(tmp_path, tiny_images):
    from capsule import capsules

    a = make_store(tmp_path / "a", tiny_images, "tiny")
    capsules.create(a, "cap", "tiny", memory="256M")
    layer = a.catalogue.latest_version("cap").chains[0][0]
    token_file = tmp_path / "a.token"
    agent = PortAgent(a.home, token_file, free_port())
    ref = raw_of(a.layer_path(layer), tmp_path / "root.raw")
    src = Source(a, layer, agent, token_file, ref, tmp_path)
    yield src
    src.agent.stop()
    a.close()


def host_b(src: Source, name: str = "b") -> Path:
    """Host B's directory: only the root layer's manifest (fetched earlier by the caller)."""
    b = src.tmp / name
    b.mkdir(exist_ok=True)
    shutil.copy(src.store.layer_manifest_path(src.layer), b / f"{src.layer}.manifest")  # type: ignore[attr-defined]
    return b


def remote_spec(src: Source, b: Path, *, url: str | None = None, children: list[LayerSpec] | None = None,
                **kw) -> ChainSpec:
    root = LayerSpec(id=src.layer, manifest_path=str(b / f"{src.layer}.manifest"),
                     remote=RemoteSpec(url or src.agent.url, str(src.token_file)))
    kw.setdefault("stats_interval", 0.1)
    return ChainSpec(layers=(root, *(children or [])), shadow_dir=str(b / "shadows"), **kw)


def make_child(src: Source, b: Path) -> LayerSpec:
    """A local child layer over the remote root: 64 KiB of 0x5a at 1 MiB, 64 KiB of zeros at 2 MiB."""
    child = b / "child.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(src.layer_path), "-F", "qcow2",
                    "-o", "cluster_size=131072,extended_l2=on", str(child)], check=True)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 1M 64k", "-c", "write -z 2M 64k", str(child)],
                   check=True, capture_output=True)
    m = manifest_of_layer(child, src.layer)
    m.write(b / "child.manifest")
    return LayerSpec(id=m.digest, manifest_path=str(b / "child.manifest"), local_path=str(child))


def block_of_source(src: Source, index: int) -> bytes:
    with Qcow2Image(src.layer_path) as img:
        return img.read_block(index) or bytes(BLOCK_SIZE)


def test_wrong_manifests_are_refused(source):
    b = host_b(source)
    spec = remote_spec(source, b)
    bad = replace(spec, layers=(replace(spec.layers[0], id="f" * 64),))
    with pytest.raises(SpecError, match="is that of layer"):
        Chain.open(bad)
    child = make_child(source, b)
    orphan = replace(spec, layers=(child,))  # a child layer given as a root
    with pytest.raises(SpecError, match="names parent"):
        Chain.open(orphan)
    other = b / "other.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(other), "64M"], check=True)
    wrong_file = replace(spec, layers=(spec.layers[0], replace(child, local_path=str(other))))
    with pytest.raises(SpecError, match="do not belong together|does not store"):
        Chain.open(wrong_file)


# -- reading --------------------------------------------------------------------------------------------------


def test_remote_root_reads_equal_the_source(source):
    b = host_b(source)
    data = source.data_blocks()
    with Chain.open(remote_spec(source, b)) as chain:
        assert chain.size == len(source.ref)
        assert chain.read(0, chain.size) == source.ref
        s = chain.stats()
        assert s["source_blocks"] == len(set(data)) - s["dedup_blocks"]
        assert s["zero_blocks"] + s["miss_blocks"] == chain.nblocks
        rng = random.Random(1)
        for _ in range(300):  # unaligned offsets and lengths
            off = rng.randrange(chain.size)
            n = min(rng.randrange(1, 3 * BLOCK_SIZE), chain.size - off)
            assert chain.read(off, n) == source.ref[off:off + n]
        assert chain.read(chain.size, 0) == b""
        with pytest.raises(ValueError, match="outside the disk"):
            chain.read(chain.size - 1, 2)
        assert chain.stats()["source_blocks"] == s["source_blocks"]  # nothing fetched twice
        chain.flush()
        assert chain.complete()
    with Shadow(b / "shadows" / source.layer, source.manifest.block_count) as sh:
        assert not sh.missing(data)


def test_local_child_over_remote_root(source):
    b = host_b(source)
    child = make_child(source, b)
    want = raw_of(Path(child.local_path), b / "child.raw")
    assert want[1 << 20:(1 << 20) + 65536] == b"\x5a" * 65536
    assert want[2 << 20:(2 << 20) + 65536] == bytes(65536)
    with Chain.open(remote_spec(source, b, children=[child])) as chain:
        assert chain.read(0, chain.size) == want
        s = chain.stats()
        assert s["local_blocks"] == 16
        assert chain.read((1 << 20) - 100, 200) == want[(1 << 20) - 100:(1 << 20) + 100]
        # the child's blocks are never fetched: they hide the root's
        hidden = {i for i in range(256, 272)} | {i for i in range(512, 528)}
        assert s["source_blocks"] + s["dedup_blocks"] == len(set(source.data_blocks()) - hidden)
        ext = chain.extents(2 << 20, 65536)
        assert ext == [(2 << 20, 65536, True)]


def test_random_reads_fetch_little_more_than_they_read_and_shadows_are_reused(source):
    b = host_b(source)
    data = source.data_blocks()
    rng = random.Random(7)
    picks = [rng.choice(data) for _ in range(300)]
    with Chain.open(remote_spec(source, b)) as chain:
        for i in picks:
            assert chain.read(i * BLOCK_SIZE, BLOCK_SIZE) == source.ref[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        s = chain.stats()
        assert s["guest_bytes"] == 300 * BLOCK_SIZE
        assert s["source_bytes"] / s["guest_bytes"] <= 1.1
        for i in picks:  # second pass: all local
            chain.read(i * BLOCK_SIZE, BLOCK_SIZE)
        assert chain.stats()["source_bytes"] == s["source_bytes"]
    with Chain.open(remote_spec(source, b)) as again:  # a new process would see the same shadow
        for i in picks:
            assert again.read(i * BLOCK_SIZE, BLOCK_SIZE) == source.ref[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        s2 = again.stats()
        assert s2["source_blocks"] == 0 and s2["fetch_requests"] == 0
        assert s2["shadow_blocks"] == 300


def test_sequential_reads_grow_the_read_ahead(source):
    b = host_b(source)
    data = sorted(source.data_blocks())
    start = data[0]
    run = start
    while run + 1 in set(data):
        run += 1
    count = min(run - start + 1, 512)
    assert count >= 64, "the tiny image has a long run of data blocks"
    with Chain.open(remote_spec(source, b, readahead=ReadaheadSpec(4, 128))) as chain:
        for i in range(start, start + count, 4):
            n = min(4, start + count - i)
            assert chain.read(i * BLOCK_SIZE, n * BLOCK_SIZE) == source.ref[i * BLOCK_SIZE:(i + n) * BLOCK_SIZE]
        s = chain.stats()
        assert s["readahead_blocks"] > count // 2
        assert s["fetch_requests"] < count // 16, json.dumps(s)


def test_concurrent_readers_fetch_each_block_once(source):
    b = host_b(source)
    chain = Chain.open(remote_spec(source, b))
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                off = rng.randrange(0, 8 << 20)  # where the tiny image keeps its data
                n = rng.choice([512, 4096, 65536, 200_000])
                n = min(n, chain.size - off)
                if chain.read(off, n) != source.ref[off:off + n]:
                    raise AssertionError(f"wrong data at {off}+{n}")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors[0]
        s = chain.stats()
        assert s["source_blocks"] + s["dedup_blocks"] <= len(source.data_blocks())
    finally:
        chain.close()


def test_synchronous_store_mode(source):
    b = host_b(source)
    i = source.data_blocks()[10]
    with Chain.open(remote_spec(source, b, write_behind=False)) as chain:
        assert chain.read(i * BLOCK_SIZE, BLOCK_SIZE) == block_of_source(source, i)
        with Shadow(b / "shadows" / source.layer, source.manifest.block_count) as sh:
            assert sh.has(i)  # durable before the read returned


# -- the hash cache -------------------------------------------------------------------------------------------


def test_primed_hash_cache_means_nothing_travels(source):
    b = host_b(source)
    elsewhere = source.tmp / "elsewhere"
    elsewhere.mkdir()
    copy = elsewhere / "copy.qcow2"
    shutil.copy(source.layer_path, copy)
    with HashCache.open(b / "hashcache.bin", 4 << 20) as hc:
        assert hc.insert_file(copy, source.manifest) > 0
    with Chain.open(remote_spec(source, b, hash_cache=str(b / "hashcache.bin"))) as chain:
        assert chain.read(0, chain.size) == source.ref
        s = chain.stats()
        assert s["source_blocks"] == 0 and s["fetch_requests"] == 0
        assert s["cache_blocks"] == len(source.data_blocks())


def test_fetched_blocks_feed_the_hash_cache(source):
    b = host_b(source)
    hc = str(b / "hashcache.bin")
    with Chain.open(remote_spec(source, b, hash_cache=hc)) as chain:
        chain.read(0, chain.size)
        chain.flush()
        assert chain.stats()["cache_inserts"] > 0
    # another chain with its own shadows finds every block through the cache (in the first shadow)
    other = replace(remote_spec(source, b, hash_cache=hc), shadow_dir=str(b / "shadows2"))
    with Chain.open(other) as chain2:
        assert chain2.read(0, chain2.size) == source.ref
        s = chain2.stats()
        assert s["source_blocks"] == 0 and s["cache_blocks"] == len(source.data_blocks())


# -- failures -------------------------------------------------------------------------------------------------


@pytest.fixture
def lying_source(source, monkeypatch):
    """An in-process agent for store A that flips a bit of one data block."""
    import uvicorn

    from capsule.agent.app import create_app
    from capsule.store.objectio import BlockReader

    victim = source.data_blocks()[5]
    real_read = BlockReader.read

    def lying_read(self, indices):
        blocks = real_read(self, indices)
        return [blk[:-1] + bytes([blk[-1] ^ 1]) if i == victim else blk for i, blk in zip(indices, blocks,
                                                                                          strict=True)]

    monkeypatch.setattr(BlockReader, "read", lying_read)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(source.store.home, source.agent.token), host="127.0.0.1",
                                           port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the lying agent's server to start")
    yield f"http://127.0.0.1:{port}", victim
    server.should_exit = True
    thread.join(10)


def test_a_wrong_block_is_neither_served_nor_stored(source, lying_source, caplog):
    url, victim = lying_source
    b = host_b(source)
    with Chain.open(remote_spec(source, b, url=url)) as chain:
        with pytest.raises(BlockMismatch, match=f"layer {source.layer}: block {victim} ") as exc:
            chain.read(victim * BLOCK_SIZE, BLOCK_SIZE)
        assert exc.value.block == victim and exc.value.layer_id == source.layer
        assert f"block {victim}" in caplog.text
        good = source.data_blocks()[20]
        assert chain.read(good * BLOCK_SIZE, BLOCK_SIZE) == block_of_source(source, good)
        with pytest.raises(BlockMismatch):
            chain.read(victim * BLOCK_SIZE, BLOCK_SIZE)  # still refused, never cached
        chain.flush()
        assert chain.stats()["verify_failures"] == 2
    with Shadow(b / "shadows" / source.layer, source.manifest.block_count) as sh:
        assert not sh.has(victim) and sh.has(good)


def test_unreachable_source_fails_after_the_retry_window_and_recovers(source):
    b = host_b(source)
    data = source.data_blocks()
    cached, uncached = data[3], data[300]
    with Chain.open(remote_spec(source, b, retry=RetrySpec(seconds=1.0, initial_delay=0.05, max_delay=0.2))) as chain:
        chain.read(cached * BLOCK_SIZE, BLOCK_SIZE)
        source.agent.stop()
        t0 = time.monotonic()
        with pytest.raises(SourceUnavailable, match=f"layer {source.layer[:12]}: source .* unreachable"):
            chain.read(uncached * BLOCK_SIZE, BLOCK_SIZE)
        assert 0.8 <= time.monotonic() - t0 < 5
        assert chain.read(cached * BLOCK_SIZE, BLOCK_SIZE) == block_of_source(source, cached)
        assert chain.stats()["fetch_errors"] == 1
        source.restart_agent()
        assert chain.read(uncached * BLOCK_SIZE, BLOCK_SIZE) == block_of_source(source, uncached)


# -- prefetch -------------------------------------------------------------------------------------------------


def test_prefetch_leaves_nothing_depending_on_the_source(source):
    b = host_b(source)
    child = make_child(source, b)
    want = raw_of(Path(child.local_path), b / "child.raw")
    seen: list[tuple[int, int]] = []
    with Chain.open(remote_spec(source, b, children=[child], prefetch_batch_blocks=100)) as chain:
        assert not chain.complete()
        assert chain.remaining_bytes() == len(source.data_blocks()) * BLOCK_SIZE
        n = chain.prefetch(progress=lambda d, t: seen.append((d, t)))
        assert n == len(source.data_blocks())
        assert chain.complete() and chain.remaining_bytes() == 0
        assert seen[-1][0] == seen[-1][1] == n * BLOCK_SIZE
        assert chain.prefetch() == 0
    source.agent.stop()
    with Chain.open(remote_spec(source, b, children=[child], retry=RetrySpec(seconds=0.2))) as chain:
        assert chain.complete()
        assert chain.read(0, chain.size) == want
        assert chain.stats()["fetch_attempts"] == 0


def test_prefetch_stops_on_request_and_yields_to_reads(source):
    b = host_b(source)
    stop = threading.Event()
    with Chain.open(remote_spec(source, b, prefetch_batch_blocks=8)) as chain:
        def progress(done: int, total: int) -> None:
            if done >= 16 * BLOCK_SIZE:
                stop.set()

        n = chain.prefetch(progress=progress, stop_event=stop)
        assert 0 < n < len(source.data_blocks())
        assert not chain.complete()


def test_prefetch_waits_while_foreground_reads_miss(source):
    b = host_b(source)
    with Chain.open(remote_spec(source, b)) as chain:
        chain._fg_busy = 1  # a foreground read is fetching
        done = threading.Event()
        t = threading.Thread(target=lambda: (chain._yield_to_foreground(None), done.set()))
        t.start()
        assert not done.wait(0.3)
        chain._fg_busy = 0
        chain._fg_last = time.monotonic()
        assert done.wait(2)
        t.join()
        # prefetch and foreground reads together: both finish, data correct, each block fetched once
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                rng = random.Random(5)
                for i in [rng.choice(source.data_blocks()) for _ in range(100)]:
                    assert chain.read(i * BLOCK_SIZE, BLOCK_SIZE) == block_of_source(source, i)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        rt = threading.Thread(target=reader)
        rt.start()
        chain.prefetch()
        rt.join()
        assert not errors, errors[0]
        assert chain.complete()
        s = chain.stats()
        assert s["source_blocks"] + s["dedup_blocks"] <= len(source.data_blocks()) + 100
