"""A fleet of four hosts (stores + agents on loopback, no guests) and the administrator's store: staged
rollout with a canary and waves, a host down then caught up on a rerun, fan-out seen from the agents'
side, the stop at --max-failures, rollback, and bad input that changes nothing on any host."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from capsule import audit, capsules
from capsule.accounts import tokens
from capsule.cli.main import app as cli
from capsule.errors import AuthFailed, NotFound, PeerError
from capsule.fleet import hostops, members
from capsule.fleet import push as pushing
from capsule.fleet.status import status
from testkit.fleetkit import new_version
from testkit.images import make_store
from tests.conftest import Agent

pytestmark = pytest.mark.tools

NAMES = ["h1", "h2", "h3", "h4"]
MiB = 1 << 20


class Fleet:
    def __init__(self, tmp_path, images):
        self.tmp = tmp_path
        self.origin = make_store(tmp_path / "origin", images, "tiny")
        capsules.create(self.origin, "web", "tiny", memory="256M")
        new_version(self.origin, "web", 2 * MiB, seed=2)           # web@2: one new 2 MiB layer
        self.stores = {n: make_store(tmp_path / n, images, "tiny") for n in NAMES}
        self.agents = {n: Agent(self.stores[n].home, tmp_path / f"{n}.token") for n in NAMES}
        for n in NAMES:
            members.add(self.origin, n, self.agents[n].url, self.agents[n].token, "edge")

    def restart(self, n):
        old = self.agents[n]
        old.stop()
        self.agents[n] = Agent(self.stores[n].home, old.token_file, port=old.port)

    def holds(self, n, ref):
        name, _, v = ref.partition("@")
        return self.stores[n].catalogue.version(name, int(v)) is not None

    def activity(self, n):
        return hostops.activity(members.get(self.origin, n))

    def close(self):
        for a in self.agents.values():
            a.stop()


@pytest.fixture
def fleet(tmp_path, tiny_images):
    f = Fleet(tmp_path, tiny_images)
    yield f
    f.close()


def _states(report):
    return {r.host: r.state for r in report.outcome.results}


def test_canary_waves_down_host_caught_up_on_rerun_and_fanout_from_peers(fleet):
    fleet.agents["h4"].stop()                                   # one host down
    events = []
    opts = pushing.PushOptions(canary=1, waves=[50, 100], parallel=1)
    report = pushing.push(fleet.origin, "web@2", opts, on_event=lambda r: events.append((r.host, r.state)))
    assert [s.name for s in report.plan.stages] == ["canary", "wave 1 (50%)", "wave 2 (100%)"]
    assert [list(s.hosts) for s in report.plan.stages] == [["h1"], ["h2"], ["h3", "h4"]]
    assert report.outcome.completed and report.outcome.failures == 0
    assert _states(report) == {"h1": "done", "h2": "done", "h3": "done", "h4": "offline"}
    assert all(fleet.holds(n, "web@2") for n in ("h1", "h2", "h3")) and not fleet.holds("h4", "web@2")
    # the canary ended before the first wave's host started
    assert events.index(("h1", "done")) < events.index(("h2", "sending"))
    # the canary came from the origin; with fan-out the next ones pulled from a peer
    sources = {r.host: r.source for r in report.outcome.results}
    assert sources["h1"] == "origin" and sources["h2"] == "h1"
    # … as the agents themselves tell: h2 pulled from h1's URL, and h1 served the blocks
    pulls = fleet.activity("h2")["pulls"]
    assert [(p["ref"], p["source"]) for p in pulls] == [("web@2", fleet.agents["h1"].url)]
    assert pulls[0]["wire_bytes"] > MiB                           # the new layer's random bytes travelled
    assert fleet.activity("h1")["served_blocks"] >= 2 * MiB // 4096
    assert fleet.activity("h1")["pulls"] == []                  # h1 got it from the origin's push
    # h2 pulled with a grant h1 minted for the rollout: to read web@2 only, expiring; never the origin's token
    grants = tokens.tokens(fleet.stores["h1"], tokens.HOST_USER)
    assert [(g.grant.describe() if g.grant else None, g.expires is not None) for g in grants] == [("read web@2", True)]
    assert [e["action"] for e in audit.entries(fleet.stores["h1"].home) if "grants" in e["action"]] == \
        ["POST /v1/grants/host"]
    # the down host comes back: the rerun sends it only there, from a peer, not the origin
    fleet.restart("h4")
    before = {n: fleet.activity(n)["pulls"] for n in ("h1", "h2", "h3")}
    again = pushing.push(fleet.origin, "web@2", opts)
    assert _states(again) == {"h1": "already", "h2": "already", "h3": "already", "h4": "done"}
    h4 = next(r for r in again.outcome.results if r.host == "h4")
    assert h4.source in ("h1", "h2", "h3") and fleet.holds("h4", "web@2")
    assert [p["source"] for p in fleet.activity("h4")["pulls"]] == [fleet.agents[h4.source].url]
    assert {n: fleet.activity(n)["pulls"] for n in ("h1", "h2", "h3")} == before  # nothing resent


def test_stop_at_max_failures_is_exact(fleet):
    # h1 and h2 made their own web@2: a push there must fail (with the reason), never overwrite it
    for n in ("h1", "h2"):
        capsules.create(fleet.stores[n], "web", "tiny", memory="256M")
        new_version(fleet.stores[n], "web", 64 * 1024, seed=100 + int(n[1]))
    opts = pushing.PushOptions(parallel=1, fanout=False, max_failures=1)
    report = pushing.push(fleet.origin, "web@2", opts)
    states = _states(report)
    assert states == {"h1": "failed", "h2": "failed", "h3": "not started", "h4": "not started"}
    assert report.outcome.failures == 2
    assert "at host h2" in report.outcome.stopped and "--max-failures 1" in report.outcome.stopped
    assert "other content" in next(r.reason for r in report.outcome.results if r.host == "h1")
    assert not fleet.holds("h3", "web@2") and not fleet.holds("h4", "web@2")
    # with one more failure tolerated, the others get it and the two hosts keep their own web@2
    report = pushing.push(fleet.origin, "web@2", pushing.PushOptions(parallel=1, fanout=False, max_failures=2))
    assert _states(report) == {"h1": "failed", "h2": "failed", "h3": "done", "h4": "done"}
    assert report.outcome.completed
    theirs = fleet.stores["h1"].catalogue.version("web", 2)
    assert theirs.chains != fleet.origin.catalogue.version("web", 2).chains


def test_rollback_puts_the_earlier_version_back(fleet):
    pushing.push(fleet.origin, "web@2", pushing.PushOptions())
    new_version(fleet.origin, "web", MiB, seed=3)               # web@3
    fleet.agents["h4"].stop()
    pushing.push(fleet.origin, "web@3", pushing.PushOptions())   # h4 is down: it keeps only web@2
    assert status(fleet.origin)["capsules"] == {"web": 3}
    fleet.restart("h4")
    fleet.agents["h3"].stop()
    report = pushing.rollback(fleet.origin, "web", "@2", pushing.PushOptions())
    assert report.ref == "web@2" and report.outcome.completed
    states = _states(report)
    assert states == {"h1": "already", "h2": "already", "h3": "offline", "h4": "already"}
    assert all("does not run here" in (r.activation or "") for r in report.outcome.results
               if r.state in ("already", "done"))
    st = status(fleet.origin)
    assert st["capsules"] == {"web": 2}
    rows = {r["host"]: r for r in st["hosts"]}
    assert rows["h1"]["capsules"]["web"] == {"target": 2, "holds": [2, 3], "running": None, "current": True}
    assert rows["h4"]["capsules"]["web"]["holds"] == [2] and rows["h4"]["capsules"]["web"]["current"]
    assert not rows["h3"]["reachable"] and rows["h3"]["capsules"]["web"]["holds"] is None
    with pytest.raises(NotFound):
        pushing.rollback(fleet.origin, "web", "@9", pushing.PushOptions())


def _snapshot(fleet):
    return {n: [(v.capsule, v.number) for v in fleet.stores[n].catalogue.versions()] for n in NAMES}


def test_bad_input_is_refused_and_changes_nothing_on_any_host(fleet, tiny_images):
    before = _snapshot(fleet)
    with pytest.raises(NotFound, match="not in the fleet: nope"):
        pushing.push(fleet.origin, "web@2", pushing.PushOptions(hosts=["h1", "nope"]))
    with pytest.raises(NotFound):
        pushing.push(fleet.origin, "web@7", pushing.PushOptions())
    with pytest.raises(NotFound, match="no host in group"):
        pushing.push(fleet.origin, "web@2", pushing.PushOptions(group="core"))
    # h3's agent comes back with another token: the rollout refuses before sending anything anywhere
    token_file = fleet.agents["h3"].token_file
    fleet.agents["h3"].stop()
    token_file.write_text("x" * 40 + "\n")
    fleet.restart("h3")
    with pytest.raises(AuthFailed, match="h3.*nothing was sent"):
        pushing.push(fleet.origin, "web@2", pushing.PushOptions())
    assert _snapshot(fleet) == before
    # only h1, h2, h4 asked for; h4's address now serves another store (a host replaced, say)
    old = fleet.agents["h4"]
    old.stop()
    stranger = make_store(fleet.tmp / "stranger", tiny_images, "tiny")
    fleet.agents["h4"] = Agent(stranger.home, old.token_file, port=old.port)
    with pytest.raises(PeerError, match="h4.*another store"):
        pushing.push(fleet.origin, "web@2", pushing.PushOptions(hosts=["h1", "h2", "h4"]))
    assert stranger.catalogue.versions() == []
    assert _snapshot(fleet) == before
    assert all(fleet.activity(n)["pulls"] == [] and fleet.activity(n)["served_reads"] == 0
               for n in ("h1", "h2"))


def test_cli_status_push_and_errors(fleet):
    runner = CliRunner()
    home = str(fleet.origin.home)
    r = runner.invoke(cli, ["--home", home, "fleet", "ls", "--json"])
    assert r.exit_code == 0, r.output
    assert [m["host"] for m in json.loads(r.output)] == NAMES
    fleet.agents["h2"].stop()
    r = runner.invoke(cli, ["--home", home, "fleet", "push", "web@2", "--canary", "1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["completed"] and {h["host"]: h["state"] for h in out["hosts"]}["h2"] == "offline"
    r = runner.invoke(cli, ["--home", home, "fleet", "status", "--json", "--timeout", "3"])
    assert r.exit_code == 0, r.output
    rows = {h["host"]: h for h in json.loads(r.output)["hosts"]}
    assert rows["h1"]["capsules"]["web"]["current"] and not rows["h2"]["reachable"]
    # errors through the real entry point: one line, the error's exit code
    cmd = [sys.executable, "-m", "capsule.cli.main", "--home", home, "fleet"]
    r = subprocess.run([*cmd, "push", "web@2", "--waves", "50%,10%"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "waves must grow" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([*cmd, "rm", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "not in the fleet: nope" in r.stderr
