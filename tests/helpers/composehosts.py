"""The compose hosts as fixtures, for the `hosts` tier and the browser tests that need two libvirts: two Capsule
hosts in containers (docker-compose.yml), started once per session with fresh stores and shared by every test;
each test uses capsules of its own. Loaded for the whole suite by tests/conftest.py (``pytest_plugins``), so every
tier shares one session's hosts: a test module must not import these fixtures (an imported fixture is a definition
of its own, and a session fixture defined twice starts the hosts again, wiping what the first one seeded)."""

from __future__ import annotations

import os
import uuid

import pytest

from scripts.composehosts import TEST, docker_ready

SEED = "seed"


@pytest.fixture(scope="session")
def hosts():
    """host-a and host-b, up with empty stores; taken down (stores too) at the end, unless
    CAPSULE_KEEP_HOSTS=1 keeps them for a look."""
    if why := docker_ready():
        pytest.fail(why)
    TEST.compose("down", "--volumes", "--timeout", "5")
    TEST.up()
    a, b = TEST.host("host-a"), TEST.host("host-b")
    yield a, b
    if os.environ.get("CAPSULE_KEEP_HOSTS") != "1":
        TEST.compose("down", "--volumes", "--timeout", "5")


@pytest.fixture(scope="session")
def seeded(hosts, tiny_images, tmp_path_factory):
    """Host A holds capsule `seed` (the tiny image, inactive), pushed over the network from a
    store on this machine: host A never builds an image."""
    from capsule import capsules, transfer
    from testkit.images import make_store

    a, b = hosts
    local = make_store(tmp_path_factory.mktemp("local") / "store", tiny_images, "tiny")
    capsules.create(local, SEED, "tiny", memory="256M")
    transfer.push(local, SEED, a.url, a.token)
    local.close()
    return a, b


@pytest.fixture
def fresh(seeded):
    """A new capsule name on host A, derived from the seed (shares its layers)."""
    a, b = seeded
    name = f"c{uuid.uuid4().hex[:8]}"
    a.capsule("derive", SEED, name)
    return a, b, name


def known_as(host, name: str, peer) -> str:
    """The name ``host`` knows ``peer`` by (tests share the hosts: another may have added it already), adding it
    as ``name`` with the peer's token if it does not know it yet."""
    for row in host.capsule("host", "ls"):
        if row["url"] == peer.url:
            return row["name"]
    host.capsule("host", "add", name, peer.url, token=peer.token)
    return name
