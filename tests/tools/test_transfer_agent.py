"""HCP between two stores and two real agents on loopback, without guests:
tokens, hostile input, a lying peer, the hash cache, resuming a killed pull."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from capsule import capsules, transfer
from capsule.errors import AuthFailed, TransferFailed
from capsule.store.objectio import BlockReader, has_object
from capsule.transfer import pushing
from testkit.images import make_store
from tests.conftest import Agent
from tests.wait import wait_until

pytestmark = pytest.mark.tools


@pytest.fixture
def hosts(tmp_path, tiny_images):
    """A holds the tiny image and a capsule on it; B is empty. Both run agents."""
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images)
    capsules.create(a, "cap", "tiny", memory="256M")
    agent_a = Agent(a.home, tmp_path / "a.token")
    agent_b = Agent(b.home, tmp_path / "b.token")
    yield a, b, agent_a, agent_b
    agent_a.stop()
    agent_b.stop()


def _layer(store):
    return store.catalogue.latest_version("cap").chains[0][0]


def test_pull_then_push_back_sends_almost_nothing(hosts):
    a, b, agent_a, agent_b = hosts
    r = transfer.pull(b, agent_a.url, "cap", agent_a.token)
    assert r.recorded and len(r.objects) == 3  # root layer, kernel, initrd
    layer = _layer(a)
    assert has_object(b, "layer", layer)
    assert b.layer_manifest(layer).digest == layer
    t = r.totals()
    # every block travelled once; repeats within an object were copied locally
    assert t["fetched_bytes"] + t["cache_bytes"] == t["raw_bytes"] > 0
    assert t["fetched_bytes"] > 0.9 * t["raw_bytes"]
    # the wire carries less than the raw data: zstd, zero blocks never travel
    assert r.wire_bytes < t["raw_bytes"]
    again = transfer.pull(b, agent_a.url, "cap", agent_a.token)
    assert again.objects == [] and not again.recorded and again.wire_bytes < 20_000
    back = transfer.push(b, "cap", agent_a.url, agent_a.token)
    assert back.objects == [] and back.wire_bytes < 20_000


def test_push_installs_verified_objects(hosts):
    a, b, _agent_a, agent_b = hosts
    r = transfer.push(a, "cap", agent_b.url, agent_b.token)
    assert r.recorded
    assert b.catalogue.latest_version("cap").chains == a.catalogue.latest_version("cap").chains
    from capsule.verify import verify

    assert verify(b).ok


def test_primed_hash_cache_blocks_are_copied_locally(hosts, tmp_path):
    a, b, agent_a, _agent_b = hosts
    unrelated = tmp_path / "elsewhere" / "some-disk.img"
    unrelated.parent.mkdir()
    shutil.copyfile(a.layer_path(_layer(a)), unrelated)
    primed = b.hash_cache().prime_paths([unrelated.parent])
    assert primed.blocks > 0
    r = transfer.pull(b, agent_a.url, "cap", agent_a.token)
    layer = next(o for o in r.objects if o.kind == "layer")
    assert layer.cache_bytes == layer.raw_bytes and layer.fetched_bytes == 0
    assert b.hash_cache().stats()["hits"] > 0


def test_no_hash_fetches_everything(hosts, tmp_path):
    a, b, agent_a, _agent_b = hosts
    shutil.copyfile(a.layer_path(_layer(a)), tmp_path / "copy.img")
    b.hash_cache().prime_paths([tmp_path / "copy.img"])
    r = transfer.pull(b, agent_a.url, "cap", agent_a.token, transfer.Options(hash=False))
    layer = next(o for o in r.objects if o.kind == "layer")
    assert layer.cache_bytes == 0 and layer.fetched_bytes == layer.raw_bytes


def test_tokens(hosts):
    _a, _b, agent_a, _agent_b = hosts
    for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": agent_a.token}):
        assert httpx.get(f"{agent_a.url}/v1/capsules", headers=headers).status_code == 401
    with pytest.raises(AuthFailed):
        transfer.pull(_b, agent_a.url, "cap", "not-the-token-at-all")


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/v1/objects/layer/..%2F..%2Fcatalogue.sqlite", None),
    ("GET", "/v1/objects/layer/" + "0" * 63 + "z", None),
    ("GET", "/v1/objects/..%2Flayers/" + "0" * 64, None),
    ("GET", "/v1/objects/file/" + "0" * 64, None),
    ("GET", "/v1/capsules/..%2F..%2Fetc/versions/latest", None),
    ("GET", "/v1/capsules/cap/versions/0", None),
    ("GET", "/v1/capsules/cap/versions/..", None),
    ("POST", "/v1/objects/missing", b"{not json"),
    ("POST", "/v1/objects/missing", b'{"layers": ["../../x"]}'),
    ("POST", "/v1/recv/layer/" + "1" * 64 + "/begin", b"garbage"),
    ("POST", "/v1/recv/layer/" + "1" * 64 + "/blocks", b"\xff\xff\xff\xff"),
    ("POST", "/v1/recv/file/" + "1" * 64 + "/commit", b""),
    ("POST", "/v1/versions", b'{"capsule": "../evil", "number": 1}'),
    ("POST", "/v1/versions", b'[1, 2]'),
])
def test_hostile_requests_get_4xx(hosts, tmp_path, method, path, body):
    a, _b, agent_a, _agent_b = hosts
    sentinel = tmp_path / "outside"
    sentinel.write_text("untouched")
    before = sorted(p.name for p in a.home.rglob("*"))
    r = httpx.request(method, agent_a.url + path, content=body,
                      headers={"Authorization": f"Bearer {agent_a.token}"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert sentinel.read_text() == "untouched"
    after = sorted(p.name for p in a.home.rglob("*") if "hashcache" not in p.name)
    assert [p for p in after if p not in before and not p.startswith("recv")
            and p not in ("audit.log", "audit.log.lock")] == []       # the audit log and its writers' lock
    if method == "POST" and "missing" not in path:      # a refused change is audited with its error
        from capsule import audit
        assert list(audit.entries(a.home))[-1]["result"] == r.json()["error"]


def test_out_of_range_block_read_is_refused(hosts):
    a, _b, agent_a, _agent_b = hosts
    from hashcache.hcp import encode_indices

    layer = _layer(a)
    r = httpx.post(f"{agent_a.url}/v1/objects/layer/{layer}/read", content=encode_indices([10**9]),
                   headers={"Authorization": f"Bearer {agent_a.token}"})
    assert r.status_code == 400


def test_lying_agent_fails_the_transfer_and_installs_nothing(tmp_path, tiny_images, monkeypatch):
    import uvicorn

    from capsule.agent.app import create_app
    from tests.conftest import free_port

    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images)
    capsules.create(a, "cap", "tiny", memory="256M")
    layer = _layer(a)
    manifest = a.layer_manifest(layer)
    victim = [i for i, z, _h in manifest.records() if not z][5]
    real_read = BlockReader.read

    def lying_read(self, indices):
        blocks = real_read(self, indices)
        return [b[:-1] + bytes([b[-1] ^ 1]) if i == victim and self.kind == "layer" else b
                for i, b in zip(indices, blocks, strict=True)]

    monkeypatch.setattr(BlockReader, "read", lying_read)
    token = "t" * 32
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(a.home, token), host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the in-process agent to start")
    try:
        with pytest.raises(TransferFailed, match=f"block {victim}") as exc:
            transfer.pull(b, f"http://127.0.0.1:{port}", "cap", token)
        assert layer[:12] in str(exc.value)
        assert not has_object(b, "layer", layer)
        assert b.catalogue.capsule("cap") is None
        assert not list(b.layers_dir.glob("*.qcow2"))
    finally:
        server.should_exit = True
        thread.join(10)


def test_killed_pull_resumes_without_refetching(hosts):
    a, b, agent_a, _agent_b = hosts
    env = dict(os.environ, CAPSULE_HOME=str(b.home), CAPSULE_TOKEN=agent_a.token)
    cmd = [sys.executable, "-m", "capsule.cli.main", "pull", "cap", "--from", agent_a.url, "--json", "--batch", "4",
           "--inflight", "1", "--no-compress"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    layer = _layer(a)
    bitmap = b.home / "recv" / f"layer-{layer}.bitmap"
    deadline = time.monotonic() + 60
    from hashcache.shadow import Shadow

    nblocks = a.layer_manifest(layer).block_count
    while time.monotonic() < deadline:
        if bitmap.exists():
            with Shadow(b.home / "recv" / f"layer-{layer}", nblocks) as sh:
                if sh.present_count() > 40:
                    break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not has_object(b, "layer", layer)
    import json

    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    obj = next(o for o in report["objects"] if o["kind"] == "layer")
    assert obj["resumed_bytes"] > 40 * 4096
    assert obj["fetched_bytes"] <= obj["raw_bytes"] - obj["resumed_bytes"]
    assert has_object(b, "layer", layer)


def test_full_hashes_option_transfers_the_same_object(hosts):
    a, b, agent_a, _agent_b = hosts
    r = transfer.pull(b, agent_a.url, "cap", agent_a.token, transfer.Options(full_hashes=True))
    assert r.recorded
    layer = _layer(a)
    assert b.layer_manifest(layer).digest == layer


def test_push_with_the_manifest_in_many_parts(hosts, monkeypatch):
    a, b, _agent_a, agent_b = hosts
    monkeypatch.setattr(pushing, "PART_RECORDS", 100)
    r = transfer.push(a, "cap", agent_b.url, agent_b.token)
    assert r.recorded
    assert len(a.layer_manifest(_layer(a))) > 300  # so the layer went in several parts
    from capsule.verify import verify

    assert verify(b).ok


def test_manifest_parts_out_of_order_and_early_commit_are_refused(hosts):
    a, _b, _agent_a, agent_b = hosts
    from hashcache.hcp import Expectation

    layer = _layer(a)
    m = a.layer_manifest(layer)
    auth = {"Authorization": f"Bearer {agent_b.token}"}
    import zstandard

    part1 = zstandard.ZstdCompressor().compress(Expectation.part_of(m, 100, 100, 8).to_bytes())
    r = httpx.post(f"{agent_b.url}/v1/recv/layer/{layer}/begin", params={"part": 1, "parts": 3},
                   content=part1, headers=auth)
    assert r.status_code in (404, 409), r.text
    part0 = zstandard.ZstdCompressor().compress(Expectation.part_of(m, 0, 100, 8).to_bytes())
    r = httpx.post(f"{agent_b.url}/v1/recv/layer/{layer}/begin", params={"part": 0, "parts": 3},
                   content=part0, headers=auth)
    assert r.status_code == 200
    r = httpx.post(f"{agent_b.url}/v1/recv/layer/{layer}/commit", headers=auth)
    assert r.status_code == 409 and "part" in r.json()["detail"]


def test_version_records_with_strange_config_are_refused(hosts):
    a, _b, _agent_a, agent_b = hosts
    from capsule.transfer.records import version_record

    record = version_record(a, a.catalogue.latest_version("cap"))
    auth = {"Authorization": f"Bearer {agent_b.token}"}
    for bad in ({"evil": 1}, {"balloon": "x"}, {"free_page_reporting": "yes"}, {"pod_network": 1},
                {"memory_mib": "lots"}):
        rec = dict(record, config=dict(record["config"], **bad))
        r = httpx.post(f"{agent_b.url}/v1/versions", json=rec, headers=auth)
        assert r.status_code == 400, (bad, r.text)


def test_a_pod_image_travels_alone_and_the_pod_routes_refuse_bad_requests(hosts, tmp_path):
    """`pod migrate --host`'s transfer: a sealed pod image (no version) is pushed with HCP, installed
    with its role and kept by gc; sent again it stays home. The destination's pod routes refuse
    malformed requests and unknown capsules clearly, changing nothing."""
    from capsule import hierarchy
    from capsule.pod import POD_IMAGE_ROLE

    a, b, _agent_a, agent_b = hosts
    src = tmp_path / "pod.tar.zst"
    src.write_bytes(os.urandom(300_000) + bytes(200_000))
    row = a.seal_file(src, POD_IMAGE_ROLE)
    with a.catalogue.transaction():
        a.catalogue.add_file(row)
    sent = transfer.push_files(a, [(row.id, POD_IMAGE_ROLE)], agent_b.url, agent_b.token)
    assert [o.id for o in sent.objects] == [row.id] and 300_000 < sent.wire_bytes < 400_000
    there = b.catalogue.file(row.id)
    assert there is not None and there.role == POD_IMAGE_ROLE and there.size == row.size
    assert b.file_path(row.id).read_bytes() == a.file_path(row.id).read_bytes()
    hierarchy.gc(b, max_pending_age=0)
    assert b.file_path(row.id).exists(), "gc keeps pod images"
    again = transfer.push_files(a, [(row.id, POD_IMAGE_ROLE)], agent_b.url, agent_b.token)
    assert again.objects == [] and again.skipped == [row.id] and again.wire_bytes < 10_000

    auth = {"Authorization": f"Bearer {agent_b.token}"}
    for body in ({"image": row.id}, {"image": 7, "into": "x"}, ["x"], {"image": "../../etc", "into": "x"}):
        r = httpx.post(f"{agent_b.url}/v1/pods/restore", json=body, headers=auth)
        assert r.status_code == 400 and r.json()["error"] == "invalid_name", (body, r.text)
    r = httpx.post(f"{agent_b.url}/v1/pods/restore", json={"image": row.id, "into": "nosuch"}, headers=auth)
    assert r.status_code == 404 and "nosuch" in r.json()["detail"]
    r = httpx.get(f"{agent_b.url}/v1/pods", params={"capsule": "../x"}, headers=auth)
    assert r.status_code == 400
    assert httpx.get(f"{agent_b.url}/v1/pods", params={"capsule": "nosuch"}).status_code == 401
