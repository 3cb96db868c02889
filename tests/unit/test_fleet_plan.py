"""The fleet rollout's planning and running, without hosts: stages (canaries, waves), the fan-out tree,
and the executor's rules (failure threshold exactly, offline hosts skipped then done on a rerun, hosts
that hold the version not sent again, a stage only after the one before succeeded)."""

from __future__ import annotations

import threading

import pytest

from capsule.errors import InvalidName
from capsule.fleet.fanout import ORIGIN, REPOSITORY, Sources, plan_tree
from capsule.fleet.plan import parse_waves, plan_stages
from capsule.fleet.rollout import Rollout

pytestmark = pytest.mark.unit

HOSTS = [f"h{i:02d}" for i in range(1, 11)]


def test_waves_parse_and_refuse_nonsense():
    assert parse_waves("10%,50%,100%") == [10, 50, 100]
    assert parse_waves(" 25% , 100% ") == [25, 100]
    for bad in ("", "10", "50%,10%", "0%", "101%", "10%,10%", "x%", "-5%", "1e2%"):
        with pytest.raises(InvalidName):
            parse_waves(bad)


def test_canary_then_cumulative_waves():
    plan = plan_stages(HOSTS, canary=1, waves=[10, 50, 100])
    # 10% of 10 hosts is 1 host, already reached by the canary: that wave adds nobody and is no stage
    assert [(s.name, list(s.hosts)) for s in plan.stages] == [
        ("canary", ["h01"]), ("wave 2 (50%)", HOSTS[1:5]), ("wave 3 (100%)", HOSTS[5:])]
    assert plan.held_back == ()
    assert sorted(plan.hosts()) == HOSTS


def test_partial_waves_hold_hosts_back_and_round_up():
    plan = plan_stages(HOSTS[:3], waves=[50])
    assert [list(s.hosts) for s in plan.stages] == [["h01", "h02"]]  # ceil(1.5)
    assert plan.held_back == ("h03",)


def test_bad_plans_are_refused():
    with pytest.raises(InvalidName):
        plan_stages(HOSTS[:2], canary=3)
    with pytest.raises(InvalidName):
        plan_stages(HOSTS[:2], canary=-1)
    with pytest.raises(InvalidName):
        plan_stages(["a", "a"])


def test_fanout_tree_doubles_senders_each_round():
    edges = plan_tree(HOSTS[:7], [], parallel=1)
    by_round: dict[int, list] = {}
    for e in edges:
        by_round.setdefault(e.round, []).append(e)
    # round 0: origin → 1; round 1: 2 senders; round 2: 4 senders
    assert [len(by_round[r]) for r in sorted(by_round)] == [1, 2, 4]
    assert by_round[0][0].source == ORIGIN
    # peers are preferred to the origin; each host receives once, from a host that already had it
    have = {ORIGIN}
    for r in sorted(by_round):
        for e in by_round[r]:
            assert e.source in have
        have |= {e.host for e in by_round[r]}
    assert sum(1 for e in edges if e.source == ORIGIN) == 3  # one per round: the origin never idles


def test_one_sender_tree_is_bounded_by_parallel():
    edges = plan_tree(HOSTS[:8], [], parallel=3, fanout=False)
    assert {e.source for e in edges} == {ORIGIN}
    assert [sum(1 for e in edges if e.round == r) for r in range(3)] == [3, 3, 2]


def test_holders_serve_from_the_start_and_parallel_is_checked():
    edges = plan_tree(["a", "b"], ["x"], parallel=1)
    assert [(e.host, e.source, e.round) for e in edges] == [("a", "x", 0), ("b", ORIGIN, 0)]
    for bad in (0, 65):
        with pytest.raises(InvalidName):
            Sources(bad)


def test_via_a_repository_it_replaces_the_origin_bounded_by_parallel_and_peers_serve_first():
    edges = plan_tree(HOSTS[:7], [], parallel=2, last_resort=REPOSITORY)
    assert ORIGIN not in {e.source for e in edges}
    for r in {e.round for e in edges}:          # the repository serves at most --parallel hosts at a time
        assert sum(1 for e in edges if e.round == r and e.source == REPOSITORY) <= 2
    assert [(e.host, e.source) for e in edges if e.round == 0] == [("h01", REPOSITORY), ("h02", REPOSITORY)]
    round1 = [e.source for e in edges if e.round == 1]              # the holders' slots fill first
    assert {s: round1.count(s) for s in round1} == {"h01": 2, "h02": 2, REPOSITORY: 1}
    # a rollout labels where each host got it: "repository" or the peer
    plan = plan_stages(HOSTS[:3], 0, [100])
    got = Rollout(plan, transfer=lambda _h, _s, _b: 10, parallel=1, last_resort=REPOSITORY).run()
    assert [r.source for r in got.results] == ["repository", "h01", "repository"]
    with pytest.raises(InvalidName):
        Sources(1, last_resort="h01")


class FakeFleet:
    """Hosts as sets of versions; a transfer copies the version unless the host is set to fail."""

    def __init__(self, hosts, failing=(), offline=()):
        self.holds = {h: False for h in hosts}
        self.failing = set(failing)
        self.offline = set(offline)
        self.sends: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def transfer(self, host, source, on_bytes):
        assert source == ORIGIN or self.holds[source], "a source must hold the version"
        with self.lock:
            self.sends.append((host, source))
        if host in self.failing:
            raise RuntimeError(f"{host}: disk full")
        on_bytes(100)
        self.holds[host] = True
        return 100

    def rollout(self, plan, **kw):
        return Rollout(plan, transfer=self.transfer, offline={h: "no answer" for h in self.offline},
                       already={h for h, v in self.holds.items() if v}, **kw).run()


@pytest.mark.parametrize("max_failures", [0, 1, 2])
def test_stop_at_the_failure_threshold_is_exact(max_failures):
    fleet = FakeFleet(HOSTS[:6], failing={"h02", "h03", "h04"})
    out = fleet.rollout(plan_stages(HOSTS[:6]), parallel=1, fanout=False, max_failures=max_failures)
    # one transfer at a time, in order: it stops right after failure max_failures + 1
    assert [h for h, _ in fleet.sends] == HOSTS[:2 + max_failures]
    assert out.failures == max_failures + 1 and not out.completed
    assert f"at host {HOSTS[1 + max_failures]}" in out.stopped and f"--max-failures {max_failures}" in out.stopped
    states = {r.host: r.state for r in out.results}
    assert all(states[h] == "not started" for h in HOSTS[2 + max_failures:6])
    assert states["h02"] == "failed" and "disk full" in next(r.reason for r in out.results if r.host == "h02")


def test_failures_within_the_threshold_let_the_rollout_finish():
    fleet = FakeFleet(HOSTS[:6], failing={"h02", "h05"})
    out = fleet.rollout(plan_stages(HOSTS[:6]), parallel=1, fanout=False, max_failures=2)
    assert out.completed and out.failures == 2 and len(fleet.sends) == 6


def test_a_failed_canary_stops_before_any_wave():
    fleet = FakeFleet(HOSTS[:5], failing={"h01"})
    out = fleet.rollout(plan_stages(HOSTS[:5], canary=1, waves=[50, 100]), parallel=2)
    assert fleet.sends == [("h01", ORIGIN)]
    assert "stopped in canary at host h01" in out.stopped
    assert {r.state for r in out.results if r.host != "h01"} == {"not started"}


def test_next_wave_only_after_the_one_before_ended():
    fleet = FakeFleet(HOSTS)
    order = []
    plan = plan_stages(HOSTS, canary=2, waves=[50, 100])

    def event(r):
        if r.state == "sending":
            order.append((r.stage, r.host))

    out = fleet.rollout(plan, parallel=3, on_event=event)
    assert out.completed
    stages = [s for s, _ in order]
    # stages never interleave: all sends of one stage come before the next stage's
    assert stages == sorted(stages, key=[s.name for s in plan.stages].index)
    # fan-out: after the canaries, hosts mostly pull from peers
    assert sum(1 for _h, src in fleet.sends if src != ORIGIN) >= 5


def test_offline_host_is_skipped_then_done_on_rerun_without_resending_the_others():
    fleet = FakeFleet(HOSTS[:4], offline={"h03"})
    first = fleet.rollout(plan_stages(HOSTS[:4]), parallel=2)
    assert first.completed and first.failures == 0
    assert {r.host: r.state for r in first.results}["h03"] == "offline"
    assert sorted(h for h, _ in fleet.sends) == ["h01", "h02", "h04"]
    fleet.offline.clear()
    fleet.sends.clear()
    second = fleet.rollout(plan_stages(HOSTS[:4]), parallel=2)
    states = {r.host: r.state for r in second.results}
    assert states == {"h01": "already", "h02": "already", "h03": "done", "h04": "already"}
    assert [h for h, _ in fleet.sends] == ["h03"]
    assert fleet.sends[0][1] != ORIGIN  # a host that already holds it passes it on


def test_activation_runs_after_the_transfer_and_its_failure_counts():
    fleet = FakeFleet(HOSTS[:3])
    fleet.holds["h01"] = True
    activated = []

    def activate(host):
        if host == "h02":
            raise RuntimeError("guest did not boot")
        activated.append(host)
        return "started"

    out = fleet.rollout(plan_stages(HOSTS[:3]), parallel=1, fanout=False, max_failures=1, activate=activate)
    states = {r.host: (r.state, r.reason) for r in out.results}
    assert states["h01"] == ("already", None) and states["h03"] == ("done", None)
    assert states["h02"] == ("failed", "guest did not boot")
    assert sorted(activated) == ["h01", "h03"] and out.completed
