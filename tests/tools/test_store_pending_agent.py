"""gc and a push in flight, through a real agent: the objects it commits are pending until the
version is recorded."""

from __future__ import annotations

import pytest

from capsule import hierarchy
from capsule.store.objectio import has_object

pytestmark = [pytest.mark.tools]


@pytest.mark.timeout(180)
def test_a_push_whose_version_is_not_recorded_yet_survives_gc_at_the_receiver(tmp_path, tiny_images, monkeypatch):
    """Through a real agent: the objects it commits are pending until the version is recorded."""
    from capsule import capsules, transfer
    from capsule.agentclient import AgentClient
    from testkit.images import make_store
    from tests.conftest import Agent

    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images)
    capsules.create(a, "cap", "tiny", memory="256M")
    agent = Agent(b.home, tmp_path / "b.token")
    try:
        real_post = AgentClient.post_json

        def no_record(self, path, body):
            if path == "/v1/versions":
                raise RuntimeError("the sender died before recording the version")
            return real_post(self, path, body)

        monkeypatch.setattr(AgentClient, "post_json", no_record)
        with pytest.raises(RuntimeError, match="died"):
            transfer.push(a, "cap", agent.url, agent.token)
        layer = a.catalogue.latest_version("cap").chains[0][0]
        assert has_object(b, "layer", layer) and layer in {p.id for p in b.catalogue.pending()}
        r = hierarchy.gc(b)                 # gc in another process than the agent
        assert r.layers == [] and r.files == [] and layer in r.pending
        assert has_object(b, "layer", layer)

        monkeypatch.setattr(AgentClient, "post_json", real_post)
        report = transfer.push(a, "cap", agent.url, agent.token)
        assert report.recorded and report.objects == []     # nothing travelled twice
        assert b.catalogue.pending() == []
    finally:
        agent.stop()
        a.close()
        b.close()
