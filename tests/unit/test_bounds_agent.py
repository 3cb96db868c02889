"""Every number from the network is finite and bounded, or refused with a typed error naming the field, the
value and the range — through a real agent app (no guests) and a fake peer:

- ``POST /v1/capsules/{name}/start?timeout=nan`` made ``min(max(nan, 1), 900)`` NaN: a wait that never ends;
- a peer's LOOKUP reply with ``count: 10**18`` built a list of 1.5e13 (start, count) pairs before anything
  checked it;
- a received version record's ``memory_mib`` and ``vcpus`` were only type-checked (``True`` passed, and so
  did a terabyte more than any host has)."""

from __future__ import annotations

import json
import time
import tracemalloc
import uuid

import pytest
from fastapi.testclient import TestClient

from capsule import capsules, transfer
from capsule.agent.app import create_app
from capsule.errors import TransferFailed
from capsule.store import Store
from capsule.store.catalogue import ImageRow
from hashcache.blocks import BLOCK_SIZE
from hashcache.transport.base import Call, Reply
from tests.helpers.received import receive_file, receive_layer, record_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN = "the-host-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NAME = "desk"


@pytest.fixture
def agent(tmp_path):
    """An agent app on a store with one capsule (its image's objects are not there: it cannot boot)."""
    store = Store.open(tmp_path / "store")
    store.catalogue.add_image(ImageRow(name="img", kind="tiny", root_layer=uuid.uuid4().hex * 2,
                                       kernel=uuid.uuid4().hex * 2, initrd=uuid.uuid4().hex * 2,
                                       cmdline="console=ttyS0", marker="READY", info={}, created=time.time()))
    capsules.create(store, NAME, "img", memory="256M")
    with TestClient(create_app(tmp_path / "store", TOKEN)) as client:
        yield client, store
    store.close()


# -- start?timeout=nan -------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ["start", "activate"])
@pytest.mark.parametrize("timeout", ["nan", "inf", "-inf", "-1", "1e309", "0", "901", "NaN", "true"])
def test_a_start_timeout_that_is_not_a_number_of_seconds_is_refused_at_once(agent, route, timeout):
    client, store = agent
    t0 = time.monotonic()
    r = client.post(f"/v1/capsules/{NAME}/{route}", params={"version": 1, "timeout": timeout}, headers=AUTH)
    assert time.monotonic() - t0 < 5
    assert r.status_code == 400 and r.json()["error"] == "invalid_name", r.text
    detail = r.json()["detail"]
    assert "timeout" in detail and repr(timeout) in detail and "from 1 to 900 (seconds)" in detail, detail
    assert store.catalogue.instance(NAME) is None


def test_a_start_version_must_be_a_whole_version_number(agent):
    client, _ = agent
    for bad in ("true", "1.0", "0", "1000000000", "-1", "1e3"):
        r = client.post(f"/v1/capsules/{NAME}/start?version={bad}&timeout=10", headers=AUTH)
        assert r.status_code == 400 and "version" in r.json()["detail"], (bad, r.text)
        assert "a whole number from 1 to 999999999" in r.json()["detail"], r.text


def test_the_dashboards_start_refuses_the_same_numbers_in_its_body(agent):
    client, store = agent
    as_json = AUTH | {"content-type": "application/json"}
    for field, value in [("timeout", "NaN"), ("timeout", "Infinity"), ("timeout", "1e400"), ("timeout", "true"),
                         ("timeout", '"60"'), ("timeout", "0.5"), ("version", "true"), ("version", "1.0")]:
        body = f'{{"{field}": {value}}}'.encode()
        r = client.post(f"/api/capsules/{NAME}/start", content=body, headers=as_json)
        assert r.status_code == 400 and r.json()["error"] == "invalid_name", (body, r.text)
        assert f"body.{field}: " in r.json()["detail"] and " from 1 to " in r.json()["detail"], r.text
    assert store.catalogue.instance(NAME) is None


# -- a LOOKUP reply's count ------------------------------------------------------------------------------

class HostilePeer:
    """A peer that serves one version record and answers its layer's LOOKUP with ``count``; it counts the
    READ-HASH requests it gets."""

    url = "http://peer.invalid"

    def __init__(self, record: dict, size: int, count: object) -> None:
        self.record, self.size, self.count = record, size, count
        self.records_asked = 0

    def call(self, call: Call) -> Reply:
        if call.path.startswith("/v1/capsules/"):
            return Reply(200, json.dumps(self.record).encode())
        if call.path.endswith("/records"):
            self.records_asked += 1
            return Reply(200, b"")
        lid = call.path.rsplit("/", 1)[1]
        head = {"kind": "layer", "algorithm": "blake3", "block_size": BLOCK_SIZE, "size": self.size,
                "parent": None, "count": self.count, "digest": lid}
        return Reply(200, json.dumps(head).encode())

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("size", "count"), [(40 * BLOCK_SIZE, 10**18), (40 * BLOCK_SIZE, 2**36),
                                             (40 * BLOCK_SIZE, 41), (0, 1), (40 * BLOCK_SIZE, True),
                                             (2**60, 1), (40 * BLOCK_SIZE, -1)])
def test_a_lookup_reply_whose_count_its_object_cannot_hold_is_refused_before_anything_is_asked(tmp_path, size,
                                                                                               count):
    store = Store.open(tmp_path / "store")
    try:
        ids = [uuid.uuid4().hex * 2 for _ in range(3)]
        peer = HostilePeer(record_of(NAME, 1, [ids[0]], ids[1], ids[2]), size, count)
        tracemalloc.start()
        try:
            with pytest.raises(TransferFailed, match="malformed LOOKUP reply") as err:
                transfer.pull(store, peer.url, f"{NAME}@1", TOKEN, transport=peer)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert "manifest" in str(err.value) and "is not a whole number from 0 to" in str(err.value), err.value
        assert peer.records_asked == 0          # refused from the header: no READ-HASH, no list of chunks
        assert peak < 1 << 20, peak
        assert store.catalogue.version(NAME, 1) is None
    finally:
        store.close()


# -- a received version record's machine -------------------------------------------------------------------

@pytest.fixture
def received(tmp_path):
    """An agent app on a store that holds a version's objects (as a push leaves them), and its record."""
    store = Store.open(tmp_path / "store")
    work = tmp_path / "w"
    work.mkdir()
    lid, kernel, initrd = receive_layer(store, work, 1), receive_file(store, work, 2), receive_file(store, work, 3)
    with TestClient(create_app(tmp_path / "store", TOKEN)) as client:
        yield client, store, record_of(NAME, 1, [lid], kernel, initrd)
    store.close()


@pytest.mark.parametrize(("field", "value", "says"), [
    ("memory_mib", True, "True is not a whole number from 64 to 1048576 (MiB)"),
    ("memory_mib", 10**12, "1000000000000 is not a whole number from 64 to 1048576 (MiB)"),
    ("memory_mib", 2**70, "1180591620717411303424 is not a whole number"),
    ("memory_mib", -256, "-256 is not a whole number from 64"),
    ("memory_mib", 0, "0 is not a whole number from 64"),
    ("memory_mib", 256.0, "256.0 is not a whole number"),
    ("memory_mib", "256", "'256' is not a whole number"),
    ("memory_mib", float("nan"), "NaN is not a JSON number"),
    ("memory_mib", float("inf"), "Infinity is not a JSON number"),
    ("vcpus", True, "True is not a whole number from 1 to 64"),
    ("vcpus", 65, "65 is not a whole number from 1 to 64"),
    ("vcpus", 0, "0 is not a whole number from 1 to 64"),
])
def test_a_received_version_asking_for_an_impossible_machine_is_refused_and_nothing_recorded(received, field,
                                                                                              value, says):
    client, store, record = received
    bad = dict(record, config=dict(record["config"], **{field: value}))
    r = client.post("/v1/versions", content=json.dumps(bad).encode(), headers=AUTH)
    assert r.status_code == 400 and r.json()["error"] == "invalid_name", r.text
    assert says in r.json()["detail"], r.text
    if "JSON" not in says:
        assert f"config.{field}:" in r.json()["detail"], r.text
    assert store.catalogue.version(NAME, 1) is None and store.catalogue.capsule(NAME) is None
    # the same record with a machine a host can give is recorded
    r = client.post("/v1/versions", json=record, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"version": f"{NAME}@1", "created": True}, r.text


@pytest.mark.parametrize(("key", "value", "says"), [
    ("number", True, "version number: True is not a whole number from 1 to 999999999"),
    ("parent_version", 10**9, "parent version: 1000000000 is not"),
    ("created", "yesterday", "created: 'yesterday' is not a number from 0 to"),
    ("created", -1.5, "created: -1.5 is not a number from 0 to"),
])
def test_a_received_version_records_other_numbers_are_bounded_too(received, key, value, says):
    client, store, record = received
    r = client.post("/v1/versions", json=dict(record, **{key: value}), headers=AUTH)
    assert r.status_code == 400 and says in r.json()["detail"], r.text
    assert store.catalogue.capsule(NAME) is None
