"""The agent's thread pools and the per-owner limit on capsule operations (capsule/agent/workers.py), through real
HTTP on ``create_app``: lifecycle calls that fill their pool never delay HCP LOOKUP and READ; an owner's third
operation at once is refused (429, Retry-After) while another owner's goes ahead and staff are not counted; the
count comes back when an operation ends. The lifecycle library calls are fakes that wait on an event (no guest)."""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from capsule import lifecycle
from capsule.accounts import owners, tokens, users
from capsule.agent.limits import Limits
from hashcache.hcp import encode_indices
from tests.helpers.transport_fixtures import TOKEN, agent_app
from tests.unit.test_accounts_agent import OTHER, SECRET, make_home
from tests.wait import wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Blocked:
    """A stand-in for a lifecycle library call: counts who entered, waits until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, _store: Any, ref: str, *_a: Any, **_kw: Any) -> Any:
        with self._lock:
            self.entered.append(ref)
        if not self.release.wait(60):
            raise AssertionError("never released")
        version = types.SimpleNamespace(ref=f"{ref}@1")
        return types.SimpleNamespace(version=version, mode="boot", domain="d", seconds=0.0)

    def count(self) -> int:
        with self._lock:
            return len(self.entered)

    def settled(self, at_least: int) -> int:
        """How many entered, once at least ``at_least`` did and no more came for half a second."""
        wait_until(lambda: self.count() >= at_least, 20, lambda: f"{at_least} calls to enter ({self.count()} did)")
        last = -1
        while last != self.count():
            last = self.count()
            time.sleep(0.5)
        return last


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=64) as ex:
        yield ex


def test_lifecycle_calls_filling_their_pool_never_delay_block_serving(tmp_path, monkeypatch, pool):
    blocked = Blocked()
    monkeypatch.setattr(lifecycle, "stop", blocked)
    with agent_app(tmp_path / "store") as agent, TestClient(agent.app) as client:
        many = 45     # more than anyio's default 40 threads: before, lifecycle calls and HCP shared them
        stops = [pool.submit(client.post, f"/v1/capsules/c{i}/stop", headers=bearer(TOKEN)) for i in range(many)]
        running = blocked.settled(Limits.lifecycle_workers)
        try:
            lookup: Future = pool.submit(client.get, f"/v1/objects/file/{agent.file_id}", headers=bearer(TOKEN))
            read: Future = pool.submit(client.post, f"/v1/objects/file/{agent.file_id}/read",
                                       params={"compress": "false"}, content=encode_indices([0, 7]),
                                       headers=bearer(TOKEN))
            r = lookup.result(timeout=10)
            assert r.status_code == 200 and r.json()["digest"] == agent.file_id
            r = read.result(timeout=10)
            assert r.status_code == 200 and r.content == agent.data[0] + agent.data[7]
            assert not any(f.done() for f in stops)          # all the while the stops were still under way
            assert running == Limits.lifecycle_workers       # the rest wait for the lifecycle pool's threads
        finally:
            blocked.release.set()
        assert all(f.result(timeout=30).status_code == 200 for f in stops)
    assert blocked.count() == many


@pytest.fixture
def owners_app(tmp_path, monkeypatch) -> Iterator[tuple[TestClient, dict[str, str], Blocked]]:
    from capsule.agent.app import create_app
    from capsule.store import Store

    home = make_home(tmp_path)
    store = Store.open(home)
    users.add(store, "root", "admin")
    users.add(store, "alice", "owner")
    users.add(store, "bob", "owner")
    owners.set_owner(store, SECRET, "alice")
    owners.set_owner(store, OTHER, "bob")
    t = {"admin": tokens.create(store, "root", "read,capsules,host,admin")[1],
         "alice": tokens.create(store, "alice", "read,capsules")[1],
         "bob": tokens.create(store, "bob", "read,capsules")[1]}
    store.close()
    blocked = Blocked()
    monkeypatch.setattr(lifecycle, "start", blocked)
    with TestClient(create_app(home, TOKEN)) as client:
        yield client, t, blocked


def test_an_owners_third_operation_at_once_is_refused_and_other_owners_go_ahead(owners_app, pool):
    client, t, blocked = owners_app

    def start(who: str, name: str) -> Callable[[], Any]:
        return lambda: client.post(f"/v1/capsules/{name}/start", headers=bearer(t[who]))

    try:
        first = [pool.submit(start("alice", SECRET)) for _ in range(2)]
        blocked.settled(2)
        third = pool.submit(start("alice", SECRET)).result(timeout=10)      # refused at once, not queued
        assert third.status_code == 429 and third.headers["Retry-After"] == "10"
        body = third.json()
        assert body["error"] == "too_many_operations" and body["limit"] == 2 and body["retry_after"] == 10
        assert "alice already has 2 capsule operations under way" in body["detail"]
        # the dashboard's calls count the same
        r = pool.submit(lambda: client.post(f"/api/capsules/{SECRET}/start", json={},
                                            headers=bearer(t["alice"]))).result(timeout=10)
        assert r.status_code == 429 and r.json()["error"] == "too_many_operations"
        # another owner, and staff, are not held up by alice's count
        bobs = pool.submit(start("bob", OTHER))
        staff = [pool.submit(start("admin", SECRET)) for _ in range(3)]
        assert blocked.settled(6) == 6
        assert sorted(blocked.entered) == sorted([OTHER] + [SECRET] * 5)
    finally:
        blocked.release.set()
    assert all(f.result(timeout=20).status_code == 200 for f in [*first, bobs, *staff])
    # the count came back with the answers: alice may start again
    r = pool.submit(start("alice", SECRET)).result(timeout=10)
    assert r.status_code == 200


def test_out_of_range_limits_are_refused():
    from capsule.errors import InvalidName

    for bad in ({"per_owner": 0}, {"lifecycle_workers": 0}, {"serving_workers": 0}):
        with pytest.raises(InvalidName, match="limits out of range"):
            Limits(**bad)
