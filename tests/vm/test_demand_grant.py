"""A demand run read with a grant (§4.3 once accounts exist): the destination pages the disk in with a grant
of the source to read that capsule; stopping the run ends the grant at the source and forgets it here; a
later start says why it cannot read the source, and a new run with a new grant works again."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle, transfer
from capsule.accounts import grants, tokens, users
from capsule.errors import Conflict
from capsule.lifecycle import demand
from testkit.images import make_store
from tests.conftest import Agent
from tests.helpers.guest import run

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]


def test_stopping_a_demand_run_ends_its_grant_at_the_source(tmp_path, tiny_images):
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images)
    agent = Agent(a.home, tmp_path / "a.token")
    try:
        capsules.create(a, "cap", "tiny", memory="256M")
        users.add(a, "root", "admin")                     # the old host token no longer works at A
        grant = grants.for_demand_run(a, agent.token, "cap", "unix:test")
        gid = grant.split("_")[1]
        r = transfer.run(b, agent.url, "cap", grant)
        assert r.remote_layers and run(b, "cap", "echo ok") == "ok"
        lifecycle.stop(b, "cap", force=True)
        assert tokens.get(a, gid).state() == "revoked"     # A's grant ended with the run
        assert not demand.token_path(b, agent.url).exists()
        with pytest.raises(Conflict, match="grant to read it there ended"):
            lifecycle.start(b, "cap")
        again = grants.for_demand_run(a, agent.token, "cap", "unix:test")
        r = transfer.run(b, agent.url, "cap@1", again)      # a new run, a new grant
        assert run(b, "cap", "echo ok") == "ok" and tokens.get(a, again.split("_")[1]).state() == "active"
        lifecycle.stop(b, "cap", force=True)
        assert tokens.get(a, again.split("_")[1]).state() == "revoked"
    finally:
        agent.stop()
        a.close()
        b.close()
