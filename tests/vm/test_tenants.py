"""No tenant can stall the others: one owner's guest ignores the ACPI power button (the tiny guest runs no acpid,
so the button does nothing), and while that owner's stop waits for it, another owner boots and snapshots their own
capsule through the same agent; an operation on the stopping capsule itself is refused saying so. Real guests,
through the agent's HTTP API (``create_app`` under a TestClient) with two owners' tokens."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from capsule import capsules
from capsule.accounts import owners, tokens, users
from capsule.agent.app import create_app
from capsule.runtime.connection import lookup_domain
from capsule.store import claims
from tests.helpers.guest import guest, run, write_blocks

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

TOKEN = "the-host-token-0123456789abcdef"
STOP_WAIT = 600.0       # the stop's clean-shutdown timeout: far longer than the other owner's work
OTHERS_DEADLINE = 180.0  # the other owner's boot and snapshot must be done well within it


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as ex:
        yield ex


def test_a_guest_ignoring_acpi_stalls_only_its_own_capsule(store, pool):
    capsules.create(store, "alices", "tiny", memory="256M")
    capsules.create(store, "bobs", "tiny", memory="256M")
    users.add(store, "alice", "owner")
    users.add(store, "bob", "owner")
    owners.set_owner(store, "alices", "alice")
    owners.set_owner(store, "bobs", "bob")
    alice = {"Authorization": f"Bearer {tokens.create(store, 'alice', 'read,capsules')[1]}"}
    bob = {"Authorization": f"Bearer {tokens.create(store, 'bob', 'read,capsules')[1]}"}
    with TestClient(create_app(store.home, TOKEN)) as client:
        r = client.post("/api/capsules/alices/start", json={"wait": True}, headers=alice)
        assert r.status_code == 200, r.text
        write_blocks(store, "alices", seek=50, count=2)       # what the stop must keep once the guest is off
        stop = pool.submit(client.post, "/api/capsules/alices/stop", json={"timeout": STOP_WAIT}, headers=alice)
        try:
            time.sleep(3)                     # the power button pressed, the guest ignoring it
            assert not stop.done() and lookup_domain(store.domain_name("alices")) is not None
            t0 = time.monotonic()
            # bob's own capsule: boots and is snapshotted while alice's stop waits for her guest
            r = pool.submit(client.post, "/api/capsules/bobs/start", json={"wait": True},
                            headers=bob).result(timeout=OTHERS_DEADLINE)
            assert r.status_code == 200 and r.json()["mode"] == "boot", r.text
            r = pool.submit(client.post, "/api/capsules/bobs/snapshot", json={},
                            headers=bob).result(timeout=OTHERS_DEADLINE)
            assert r.status_code == 200 and r.json()["resumed"]["mode"] == "restore", r.text
            others = time.monotonic() - t0
            assert not stop.done(), stop.result().text        # alice's stop is still waiting ...
            assert lookup_domain(store.domain_name("alices")) is not None   # ... for a guest that ignored ACPI
            # on alice's own capsule meanwhile: refused at once, saying what is under way
            r = client.post("/api/capsules/alices/suspend", json={}, headers=alice)
            assert r.status_code == 409 and r.json()["error"] == "capsule_busy", r.text
            assert "capsule 'alices' is stopping" in r.json()["detail"]
            print(f"bob's boot and snapshot took {others:.1f} s while alice's stop waited")
        finally:
            # the guest powers itself off: the stop that waited for it goes on and records its disk
            with guest(store, "alices") as console:
                console.send("poweroff -f\n")
        r = stop.result(timeout=120)
        assert r.status_code == 200 and r.json()["version"] == "alices@2", r.text   # its disk changes kept
        assert store.catalogue.instance("alices") is None and claims.holder(store, "alices") is None
        assert run(store, "bobs", "echo still-here") == "still-here"
