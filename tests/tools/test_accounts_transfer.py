"""Accounts through a real `capsule serve`: a host-only token pushes and pulls (HCP, push's receiving side) but
cannot start a capsule; an owner's token cannot push; the old token is refused with its reason once an admin
exists; the receiving host's audit log names who sent what. Every refusal reaches the client as its typed error."""

from __future__ import annotations

import pytest

from capsule import audit, capsules, transfer
from capsule.accounts import tokens, users
from capsule.agentclient import AgentClient
from capsule.errors import AuthFailed, Forbidden

pytestmark = [pytest.mark.tools]


@pytest.mark.timeout(240)
def test_a_host_token_moves_versions_and_nothing_else(tmp_path, tiny_images):
    from testkit.images import make_store
    from tests.conftest import Agent

    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images)
    capsules.create(a, "cap", "tiny", memory="256M")
    agent = Agent(b.home, tmp_path / "b.token")
    try:
        users.add(b, "root", "admin")
        users.add(b, "ops", "operator")
        users.add(b, "alice", "owner")
        _, host = tokens.create(b, "ops", "host")
        _, alice = tokens.create(b, "alice", "read,capsules")

        with pytest.raises(AuthFailed, match="capsule token create"):
            transfer.push(a, "cap", agent.url, agent.token)
        with pytest.raises(Forbidden, match="scope host"):
            transfer.push(a, "cap", agent.url, alice)
        assert b.catalogue.capsule("cap") is None                       # refused: nothing arrived

        report = transfer.push(a, "cap", agent.url, host)
        assert report.recorded and b.catalogue.latest_version("cap") is not None
        c = make_store(tmp_path / "c", tiny_images)
        pulled = transfer.pull(c, agent.url, "cap", host)                 # and back out, READ and READ-HASH
        assert pulled.recorded and c.catalogue.latest_version("cap").chains == a.catalogue.latest_version(
            "cap").chains
        c.close()

        with pytest.raises(Forbidden, match="scope capsules"):
            AgentClient(agent.url, host).post_json("/v1/capsules/cap/start", {})
        assert b.catalogue.instance("cap") is None

        tid = host.split("_")[1]
        seen = [(e["who"], e["action"], e["result"]) for e in audit.entries(b.home)]
        # the refused pushes stopped at their first call, a look (which objects are missing): no line
        assert not any(who in ("host-token", f"alice/{alice.split('_')[1]}") for who, _, _ in seen)
        assert (f"ops/{tid}", "POST /v1/versions", "ok") in seen
        assert (f"ops/{tid}", "POST /v1/capsules/{name}/start", "forbidden") in seen
        assert not any(e["action"].startswith("GET ") for e in audit.entries(b.home))   # a look is no change
    finally:
        agent.stop()
        a.close()
        b.close()
