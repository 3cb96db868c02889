"""``fleet push --activate`` and ``fleet rollback`` with a real (tiny) guest on a fleet host: the running
instance of the old version is stopped — its leaf dropped, no local version made — and the new one
started; rollback starts the old one again."""

from __future__ import annotations

from pathlib import Path

import pytest

from capsule import capsules, lifecycle
from capsule.fleet import members
from capsule.fleet import push as pushing
from testkit.fleetkit import new_version
from testkit.images import destroy_domains, make_store
from tests.conftest import Agent

pytestmark = pytest.mark.vm


@pytest.fixture
def origin_and_host(tmp_path, tiny_images):
    origin = make_store(tmp_path / "origin", tiny_images, "tiny")
    host = make_store(tmp_path / "h1", tiny_images, "tiny")
    agent = Agent(host.home, tmp_path / "h1.token")
    yield origin, host, agent
    agent.stop()
    destroy_domains(host)


def test_activate_replaces_the_running_version_and_rollback_puts_it_back(origin_and_host):
    origin, host, agent = origin_and_host
    capsules.create(origin, "web", "tiny", memory="256M")
    new_version(origin, "web", 256 * 1024, seed=7, offset=48 << 20)      # web@2, away from what the guest reads
    members.add(origin, "h1", agent.url, agent.token)
    assert pushing.push(origin, "web@1", pushing.PushOptions()).outcome.completed
    lifecycle.start(host, "web@1")
    leaf = host.catalogue.instance("web").leaves[0]

    report = pushing.push(origin, "web@2", pushing.PushOptions(activate=True))
    (r,) = report.outcome.results
    assert (r.state, r.activation) == ("done", "stopped web@1, started web@2")
    inst = host.catalogue.instance("web")
    assert inst.version == 2 and inst.leaves[0] != leaf
    assert [v.number for v in host.catalogue.versions("web")] == [1, 2]   # the old leaf was dropped, not sealed
    assert not Path(leaf).exists()

    again = pushing.push(origin, "web@2", pushing.PushOptions(activate=True))
    assert [(x.state, x.activation) for x in again.outcome.results] == [("already", "web@2 already runs")]

    back = pushing.rollback(origin, "web", "@1", pushing.PushOptions())
    assert [(x.state, x.activation) for x in back.outcome.results] == [("already", "stopped web@2, started web@1")]
    assert host.catalogue.instance("web").version == 1
    lifecycle.stop(host, "web", force=True, discard=True)
    assert host.catalogue.instance("web") is None
