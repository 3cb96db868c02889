"""Fleet members (peers with a group), the status table's survey with a hung host, and the agent's fleet
routes refusing malformed requests — agents in-process, no processes."""

from __future__ import annotations

import time

import httpx
import pytest

from capsule import hosts
from capsule.errors import AlreadyExists, AuthFailed, Conflict, InvalidName, NotFound
from capsule.fleet import members
from capsule.fleet.status import status
from capsule.store import Store
from tests.helpers.inprocess_agent import InProcessAgent, SilentPeer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN_B = "b-token-of-host-b-0123456789"
TOKEN_C = "c-token-of-host-c-0123456789"


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "a")
    yield s
    s.close()


@pytest.fixture
def peer(tmp_path):
    agent = InProcessAgent(tmp_path / "b", TOKEN_B)
    yield agent
    agent.stop()


def test_add_makes_a_peer_with_a_group_and_rm_keeps_the_peer(store, peer):
    m = members.add(store, "b", peer.url, TOKEN_B, "edge")
    assert (m.name, m.group) == ("b", "edge") and m.last_seen is not None
    assert [p.name for p in hosts.peers(store)] == ["b"]
    assert [x.name for x in members.members(store, "edge")] == ["b"]
    with pytest.raises(NotFound, match="no host in group 'core'"):
        members.members(store, "core")
    with pytest.raises(AlreadyExists):
        members.add(store, "b", peer.url, TOKEN_B, "edge")
    members.remove(store, "b")
    assert members.members(store) == [] and [p.name for p in hosts.peers(store)] == ["b"]
    # a known peer joins the fleet without being asked again, but only with its URL and token
    with pytest.raises(Conflict, match="another token"):
        members.add(store, "b", peer.url, TOKEN_C)
    with pytest.raises(Conflict, match="is known at"):
        members.add(store, "b", "http://127.0.0.1:1", TOKEN_B)
    assert members.add(store, "b", peer.url, TOKEN_B).group == "default"


def test_add_checks_like_a_peer_and_records_nothing_on_failure(store, peer):
    with pytest.raises(AuthFailed):
        members.add(store, "b", peer.url, TOKEN_C)
    for bad_group in ("", "a b", "../x"):
        with pytest.raises(InvalidName):
            members.add(store, "b", peer.url, TOKEN_B, bad_group)
    with pytest.raises(InvalidName):
        members.add(store, "b", "ftp://x", TOKEN_B)
    assert members.members(store) == [] and hosts.peers(store) == []


def test_status_marks_a_hung_host_and_the_others_answer_within_the_deadline(store, peer):
    members.add(store, "b", peer.url, TOKEN_B)
    silent = SilentPeer()
    try:
        store.catalogue.query("INSERT INTO peers VALUES(?,?,?,?,?,NULL)",
                              ("hung", silent.url, TOKEN_C, "00000000", 0.0))
        store.catalogue.query("INSERT INTO fleet_members VALUES(?,?,?,?)", ("hung", "default", 0.0, None))
        store.catalogue.query("INSERT INTO fleet_capsules VALUES('web', 2, 0)")
        t0 = time.monotonic()
        st = status(store, timeout=1.0)
        assert time.monotonic() - t0 < 5
    finally:
        silent.close()
    rows = {r["host"]: r for r in st["hosts"]}
    assert rows["b"]["reachable"] and rows["b"]["capsules"]["web"] == {"target": 2, "holds": [], "running": None,
                                                                       "current": False}
    assert not rows["hung"]["reachable"] and "within 1s" in rows["hung"]["error"]
    assert rows["hung"]["last_seen"] is None and rows["hung"]["capsules"]["web"]["holds"] is None


@pytest.mark.parametrize("body", [[], {"source": "http://127.0.0.1:1", "token": TOKEN_C},
                                  {"source": "ftp://x", "token": TOKEN_C, "ref": "web@1"},
                                  {"source": "http://127.0.0.1:1", "token": "short", "ref": "web@1"},
                                  {"source": "http://127.0.0.1:1", "token": TOKEN_C, "ref": "web"},
                                  {"source": "http://127.0.0.1:1", "token": TOKEN_C, "ref": "../x@1"},
                                  *({"source": "http://127.0.0.1:1", "token": TOKEN_C, "ref": "web@1", "zstd_level": lv}
                                    for lv in (0, 20, "19", True, 3.5))])
def test_pull_requests_are_checked_before_any_contact(peer, body):
    r = httpx.post(f"{peer.url}/v1/fleet/pull", json=body, headers={"Authorization": f"Bearer {TOKEN_B}"})
    assert r.status_code == 400 and r.json()["error"] == "invalid_name"
    activity = httpx.get(f"{peer.url}/v1/fleet/activity", headers={"Authorization": f"Bearer {TOKEN_B}"}).json()
    assert activity == {"pulls": [], "served_reads": 0, "served_blocks": 0}


def test_fleet_routes_need_the_token_and_activate_needs_a_known_version(peer):
    r = httpx.post(f"{peer.url}/v1/fleet/pull", json={})
    assert r.status_code == 401
    r = httpx.post(f"{peer.url}/v1/capsules/web/activate", params={"version": 2},
                   headers={"Authorization": f"Bearer {TOKEN_B}"})
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    r = httpx.post(f"{peer.url}/v1/capsules/web/stop", headers={"Authorization": f"Bearer {TOKEN_B}"})
    assert r.status_code == 404


def test_activate_refuses_a_running_capsule_with_data_disks_and_changes_nothing(tmp_path):
    """A fleet activation drops the running instance's disk changes: with data disks that would be the
    user's data, so it is refused before anything stops."""
    from capsule.errors import Conflict
    from capsule.exchange import fleet
    from capsule.store import Store
    from capsule.store.catalogue import CapsuleRow, InstanceRow, VersionRow

    store = Store.open(tmp_path / "s")
    try:
        cat = store.catalogue
        cat.add_capsule(CapsuleRow("web", "u-1", "img", None, None, 0.0))
        for n in (1, 2):
            cat.add_version(VersionRow("web", n, None, None, None, [["sys"], ["data"]],
                                       {"kernel": "k", "initrd": "i"}, "v", 0.0))
        cat.add_instance(InstanceRow("web", 1, "capsule-x-web", ["leaf-a", "leaf-b"], [["sys"], ["data"]], "tcg",
                                     str(tmp_path)))
        with pytest.raises(Conflict, match="1 data disk.*nothing was changed"):
            fleet.activate(store, "web", 2)
        assert cat.instance("web").version == 1 and len(cat.versions("web")) == 2
    finally:
        store.close()
