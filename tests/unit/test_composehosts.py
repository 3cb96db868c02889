"""The compose hosts' settings (scripts/composehosts.py) and the demo's bookkeeping (scripts/demo_compose.py),
without docker: the test tier's hosts are never the demo's, and the demo's verdict and byte counts."""

from __future__ import annotations

import pytest

from scripts.composehosts import DEMO, TEST, Project
from scripts.demo_compose import Story, wire

pytestmark = pytest.mark.unit


def test_the_test_hosts_are_never_the_demo_hosts():
    assert TEST.name != DEMO.name
    test_env, demo_env = TEST.env(), DEMO.env()
    assert test_env["COMPOSE_PROJECT_NAME"] == TEST.name and demo_env["COMPOSE_PROJECT_NAME"] == DEMO.name
    defaults = {"CAPSULE_HOST_A_LISTEN": "127.0.0.1:7171", "CAPSULE_HOST_B_LISTEN": "127.0.0.1:7172"}  # the file's
    for key, default in defaults.items():
        assert test_env[key] != demo_env.get(key, default)
        assert test_env[key].startswith("127.0.0.1:")


def test_a_project_s_settings_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("COMPOSE_PROJECT_NAME", "someone-else")
    monkeypatch.setenv("CAPSULE_HOST_A_LISTEN", "127.0.0.1:1")
    env = Project("mine", {"CAPSULE_HOST_A_LISTEN": "127.0.0.1:2"}).env(CAPSULE_TOKEN="t")
    assert env["COMPOSE_PROJECT_NAME"] == "mine"
    assert env["CAPSULE_HOST_A_LISTEN"] == "127.0.0.1:2"
    assert env["CAPSULE_TOKEN"] == "t"
    assert env["PATH"].startswith("/usr/bin:/usr/sbin:")   # Debian's docker and docker-compose first


@pytest.mark.parametrize(("counters", "went_on"), [
    ([3, 9, 12, 20, 31], True),
    ([3, 9, 9, 20, 31], True),        # a read right after a restore may see the same count
    ([3, 9, 2, 20, 31], False),       # a reboot starts it again
    ([3, 9, 12, 20], False),          # a move is missing
])
def test_the_counter_must_go_on_across_every_move(counters, went_on):
    assert Story(counters=counters).counter_went_on is went_on


def test_a_migration_s_wire_bytes_come_from_its_last_progress():
    assert wire({"progress": {"wire_bytes": 4096, "local_bytes": 10}}) == 4096
    assert wire({"progress": None}) == 0
