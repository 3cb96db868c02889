"""`make demo-compose`'s moves (scripts/demo_compose.run), run against the test tier's hosts: a running
capsule from a store on this machine to A, A → B → A → B (demand-paged) → A by the peer's name, the
guest's counter going on throughout."""

from __future__ import annotations

import uuid

import pytest

from testkit.images import make_store

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(900)]


def test_the_demo_moves_a_running_capsule_between_the_hosts(hosts, tiny_images, tmp_path):
    from scripts.demo_compose import run

    a, b = hosts
    local = make_store(tmp_path / "local", tiny_images, "tiny")
    name = f"d{uuid.uuid4().hex[:8]}"
    said: list[str] = []
    try:
        story = run(local, a, b, name, say=said.append)

        assert story.counter_went_on, story.counters
        assert story.counters[0] > 0
        assert story.start_b["mode"] == story.start_a["mode"] == "restore"   # no reboot on either host
        # back to A only what changed travels: A holds the old version's objects
        assert story.push_ba["skipped"], story.push_ba
        assert story.push_ba["wire_bytes"] < story.push_ab["wire_bytes"] / 2, (story.push_ba, story.push_ab)
        assert story.demand_ab["mode"] == "demand" and story.home_ba["mode"] == "full"
        assert a.state(name) == "running" and b.state(name) != "running"
        for host, peer in ((a, b), (b, a)):
            known = {p["name"]: p for p in host.capsule("host", "ls")}
            assert known[peer.service]["url"] == peer.url and known[peer.service]["reachable"], known
        assert len(said) >= 8 and any("demand-paged" in line for line in said), said
    finally:
        if a.state(name) == "running":
            a.capsule("stop", name, "--force")
        local.close()
