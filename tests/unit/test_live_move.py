"""Live moves without a guest: the pre-check's reasons (from domain XML, from this store, and from a real
destination agent over HTTP), the live phases of the progress, and the bounds of --max-pause (the library
call, the command line and the dashboard's API)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from capsule import hosts
from capsule import migrate as lib
from capsule.agent.app import create_app
from capsule.errors import InvalidName
from capsule.exchange import incoming
from capsule.migrate import live, precheck
from capsule.migrate.progress import LIVE_PHASES, Tracker, planned
from capsule.runtime.connection import host_uuid
from capsule.runtime.domainxml import MachineSpec, build
from capsule.store import Store
from capsule.store.catalogue import InstanceRow
from tests.helpers.inprocess_agent import InProcessAgent
from tests.unit.test_dashboard_api import PEER_TOKEN, SECRET, TOKEN, home, sign_in  # noqa: F401 - fixture
from tests.wait import wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _xml(extra_devices: str = "", cpu: str | None = None) -> str:
    spec = MachineSpec(name="capsule-x-vm", uuid="6b1f5b8e-3f39-4c57-9a49-3b0fbbd9f0c1", memory_mib=256, vcpus=1,
                       accel="tcg", kernel=Path("/s/files/k"), initrd=Path("/s/files/i"), cmdline="quiet",
                       disks=[Path("/s/layers/leaf-1.qcow2")], console_log=Path("/s/i/console.log"),
                       agent_socket=Path("/s/i/agent.sock"))
    xml = build(spec)
    if cpu is not None:
        start, end = xml.index("<cpu"), xml.index("</cpu>") + len("</cpu>")
        xml = xml[:start] + cpu + xml[end:]
    return xml.replace("</devices>", extra_devices + "</devices>")


def test_a_capsules_own_domain_xml_has_nothing_that_cannot_move():
    assert precheck.xml_refusals(_xml()) == []


@pytest.mark.parametrize(("device", "reason"), [
    ("<hostdev mode='subsystem' type='pci'><source><address bus='1' slot='0'/></source></hostdev>", "hostdev"),
    ("<interface type='hostdev'><source><address type='pci' bus='2'/></source></interface>", "hostdev"),
    ("<shmem name='ivshmem'><model type='ivshmem-plain'/></shmem>", "shmem"),
    ("<filesystem type='mount'><source dir='/home'/><target dir='home'/></filesystem>", "filesystem"),
    ("<redirdev bus='usb' type='spicevmc'/>", "redirdev"),
])
def test_a_device_of_this_host_is_refused_with_what_to_do(device, reason):
    refusals = precheck.xml_refusals(_xml(device))
    assert [r.reason for r in refusals] == [reason]
    assert "--offline" in refusals[0].detail


def test_a_cpu_passed_through_from_this_host_is_refused():
    refusals = precheck.xml_refusals(_xml(cpu="<cpu mode='host-passthrough'/>"))
    assert [r.reason for r in refusals] == ["cpu_passthrough"]
    assert precheck.xml_refusals(_xml(cpu="<cpu mode='host-model'/>")) == []


def test_a_capsule_that_does_not_run_here_is_refused(home):  # noqa: F811
    store = Store.open(home)
    try:
        assert [r.reason for r in precheck.precheck(store, "nope", precheck.Target("http://x", "t" * 20))] == \
            ["not_found"]
        refusals = precheck.precheck(store, SECRET, precheck.Target("http://x", "t" * 20))
        assert [r.reason for r in refusals] == ["not_running"] and f"capsule start {SECRET}" in refusals[0].detail
    finally:
        store.close()


@pytest.fixture
def peer(tmp_path):
    agent = InProcessAgent(tmp_path / "b", PEER_TOKEN)
    yield agent
    agent.stop()


def test_a_destination_that_does_not_receive_live_moves_is_refused(peer, monkeypatch):
    from capsule.agent import protocol as agent_protocol

    # an agent of an older release: it names the tunnel but not live moves
    monkeypatch.setattr(agent_protocol, "NAMED", (agent_protocol.NAMED[0], b"tunnel"))
    refusals, _ = precheck.remote_refusals(SECRET, _xml(), precheck.Target(peer.url, PEER_TOKEN))
    assert [r.reason for r in refusals] == ["no_live_moves"]
    assert "upgrade it" in refusals[0].detail and "--offline" in refusals[0].detail


def test_a_destination_on_this_machines_own_libvirt_is_refused_as_the_same_host(peer):
    target = precheck.Target(peer.url, PEER_TOKEN)
    refusals, answer = precheck.remote_refusals(SECRET, _xml(), target)
    # both agents talk to this machine's one libvirtd: its host UUID is the same on both ends
    assert [r.reason for r in refusals] == ["same_host"]
    assert refusals[0].detail.startswith("the destination is this machine's own libvirt: a live move needs "
                                         "another host")
    assert answer["host"] == host_uuid() and "routes" not in answer


def test_another_hosts_libvirt_is_not_the_same_host(peer):
    client = TestClient(peer.app)
    other = "00000000-0000-4000-8000-000000000001"
    for source in (other, ""):          # another host's libvirt, or a source that names none
        r = client.post("/v1/live/check", json={"capsule": SECRET, "type": "qemu", "cpu": "", "host": source},
                        headers={"Authorization": f"Bearer {PEER_TOKEN}"})
        assert r.status_code == 200 and r.json()["refusals"] == [], r.text


def test_a_capsule_already_running_at_the_destination_is_refused(tmp_path, peer):
    there = Store.open(tmp_path / "b")
    try:
        with there.catalogue.transaction():
            there.catalogue.add_instance(InstanceRow(SECRET, 1, "capsule-y", [], [[]], "tcg", str(tmp_path)))
    finally:
        there.close()
    refusals, _ = precheck.remote_refusals(SECRET, _xml(), precheck.Target(peer.url, PEER_TOKEN))
    assert [r.reason for r in refusals] == ["same_host", "running_there"]


def test_the_destination_refuses_a_bad_prepare_and_changes_nothing(tmp_path, peer):
    client = TestClient(peer.app)
    body = {"capsule": SECRET, "version": 1, "xml": _xml(), "disks": [1]}
    r = client.post("/v1/live/prepare", json=body | {"tunnel": "../x"},
                    headers={"Authorization": f"Bearer {PEER_TOKEN}"})
    assert r.status_code == 400 and "tunnel session" in r.json()["detail"]
    r = client.post("/v1/live/prepare", json=body | {"tunnel": "a" * 32},
                    headers={"Authorization": f"Bearer {PEER_TOKEN}"})
    assert r.status_code == 404 and "push it first" in r.json()["detail"]
    assert not (tmp_path / "b" / "instances" / SECRET).exists()
    r = client.post("/v1/live/" + "0" * 32 + "/abort", headers={"Authorization": f"Bearer {PEER_TOKEN}"})
    assert r.status_code == 404
    r = client.post("/v1/live/xyz/finish", headers={"Authorization": f"Bearer {PEER_TOKEN}"})
    assert r.status_code == 400


def test_live_phases_go_forward_and_carry_the_rounds():
    events = []
    t = Tracker("vm", "office", planned("live", False), events.append, min_interval=0)
    assert t.last.phases == ("precheck", "disks", "memory", "switchover")
    t.enter("precheck")
    t.totals({"disks": 4096})
    t.object("layer", "l1", "disk", 4096, False)           # the push of the T0 version: the disks phase
    assert t.last.phase == "disks"
    t.advance(4096)
    t.enter("memory")
    t.job(iteration=1, round_bytes=1000, dirty_rate=50, remaining=9000, disk_bytes=10, wire=5000)
    t.job(iteration=1, round_bytes=800, dirty_rate=60, remaining=8000, disk_bytes=5, wire=4000)  # late, lower
    assert (t.last.round, t.last.round_bytes, t.last.disk_bytes, t.last.wire_bytes) == (1, 1000, 10, 5000)
    t.job(iteration=2, round_bytes=300, dirty_rate=40, remaining=700, disk_bytes=12, wire=6000)
    assert (t.last.round, t.last.round_bytes, t.last.dirty_rate, t.last.remaining_bytes) == (2, 300, 40, 700)
    t.job(iteration=1, round_bytes=5, dirty_rate=1, remaining=1, disk_bytes=1, wire=1)   # never back a round
    assert t.last.round == 2
    t.enter("switchover")
    t.pause(312)
    t.enter("memory")                                       # a phase passed is not entered again
    last = t.finish("done", "destination", "ok")
    assert last.phase == "switchover" and last.pause_ms == 312 and last.as_dict()["round"] == 2
    assert [e.phase for e in events if e.phase] == sorted((e.phase for e in events if e.phase),
                                                          key=LIVE_PHASES.index)


def test_post_copy_is_planned_when_asked_or_when_it_falls_back():
    assert planned("live", True) == LIVE_PHASES
    t = Tracker("vm", "office", planned("live", False), min_interval=0)
    t.enter("memory")
    t.replan(LIVE_PHASES)
    t.enter("postcopy", "pre-copy does not converge")
    assert t.last.phase == "postcopy" and t.last.phases[-1] == "postcopy"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0, 61.0])
def test_max_pause_out_of_bounds_is_refused_before_anything(bad):
    with pytest.raises(InvalidName, match="max pause"):
        lib.migrate(None, SECRET, "http://x", "t" * 20, live=True, max_pause=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "0"])
def test_the_command_line_refuses_a_max_pause_out_of_bounds(bad, home, monkeypatch):  # noqa: F811
    from capsule.cli.main import app

    monkeypatch.setenv("CAPSULE_HOME", str(home))
    r = CliRunner().invoke(app, ["migrate", SECRET, "--to", "office", "--max-pause", bad])
    assert r.exit_code != 0 and "--max-pause" in (r.output + str(r.exception or ""))


def test_the_dashboard_checks_and_bounds_a_live_move(home, peer):  # noqa: F811
    store = Store.open(home)
    try:
        hosts.add(store, "office", peer.url, PEER_TOKEN)
    finally:
        store.close()
    client = TestClient(create_app(home, TOKEN))
    h = {"X-CSRF-Token": sign_in(client)}
    r = client.get(f"/api/capsules/{SECRET}/migrate/check", params={"to": "office"})
    assert r.status_code == 200 and [x["reason"] for x in r.json()["refusals"]] == ["not_running"]
    for bad in (-1, 0, 1e9):
        r = client.post(f"/api/capsules/{SECRET}/migrate", json={"to": "office", "max_pause": bad}, headers=h)
        assert r.status_code == 400, r.text
    r = client.post(f"/api/capsules/{SECRET}/migrate", content=b'{"to": "office", "max_pause": NaN}',
                    headers=h | {"Content-Type": "application/json"})
    assert r.status_code == 400


def _half_moved(where: Path, tmp_path: Path, session: str) -> Path:
    """An incoming move prepare left behind (its instance, a leaf, the mark naming its tunnel session)."""
    store = Store.open(where)
    try:
        d = tmp_path / "incoming"
        d.mkdir()
        leaf = d / "leaf.qcow2"
        leaf.write_bytes(b"")
        (d / incoming.MARK).write_text(json.dumps({"id": "a" * 32, "version": 1, "tunnel": session}))
        with store.catalogue.transaction():
            store.catalogue.add_instance(InstanceRow(SECRET, 1, "capsule-nowhere-x", [str(leaf)], [[]], "tcg",
                                                     str(d)))
    finally:
        store.close()
    return d


def test_an_incoming_move_is_removed_when_its_tunnel_session_ends(tmp_path, peer, monkeypatch):
    monkeypatch.setenv("CAPSULE_TUNNEL_DIR", str(tmp_path / "tunnel"))
    client = TestClient(peer.app)
    auth = {"Authorization": f"Bearer {PEER_TOKEN}"}
    other = client.post("/v1/tunnel", json={"kinds": ["libvirt"]}, headers=auth).json()["session"]
    session = client.post("/v1/tunnel", json={"kinds": ["libvirt"]}, headers=auth).json()["session"]
    d = _half_moved(tmp_path / "b", tmp_path, session)
    assert client.delete(f"/v1/tunnel/{other}", headers=auth).status_code == 200
    time.sleep(0.5)
    assert d.exists()                                  # another session's end leaves it be
    assert client.delete(f"/v1/tunnel/{session}", headers=auth).status_code == 200
    wait_until(lambda: not d.exists(), 10, "the unfinished move to be removed")
    there = Store.open(tmp_path / "b")
    try:
        assert there.catalogue.instance(SECRET) is None
    finally:
        there.close()


def test_an_incoming_move_left_by_the_last_agent_is_removed_when_the_agent_starts(home, tmp_path):  # noqa: F811
    d = _half_moved(home, tmp_path, "b" * 32)
    create_app(home, TOKEN)
    store = Store.open(home)
    try:
        assert store.catalogue.instance(SECRET) is None and not d.exists()
    finally:
        store.close()


def test_a_guest_that_already_runs_here_is_adopted_never_destroyed(home, tmp_path, monkeypatch):  # noqa: F811
    """The source went away between the switchover and finish: the guest runs only here now. The sweep at the
    agent's start keeps it as this host's instance instead of destroying the one copy of the machine."""
    import libvirt

    destroyed: list[str] = []

    class Running:
        def state(self):
            return libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_MIGRATED

        def destroy(self):
            destroyed.append("x")

        def isActive(self):
            return True

    d = _half_moved(home, tmp_path, "c" * 32)
    monkeypatch.setattr(incoming, "lookup_domain", lambda _name: Running())
    create_app(home, TOKEN)
    store = Store.open(home)
    try:
        assert store.catalogue.instance(SECRET) is not None and d.exists() and not destroyed
        assert not (d / incoming.MARK).exists()            # no longer an unfinished move: this host's instance
    finally:
        store.close()


def test_a_live_move_throttles_a_guest_that_outruns_the_link_unless_post_copy_was_asked_for():
    import libvirt

    from capsule.migrate.live import migrate_flags

    precopy, postcopy = migrate_flags(False), migrate_flags(True)
    for flags in (precopy, postcopy):
        assert flags & libvirt.VIR_MIGRATE_LIVE and flags & libvirt.VIR_MIGRATE_NON_SHARED_INC
        assert flags & libvirt.VIR_MIGRATE_NON_SHARED_SYNCHRONOUS_WRITES   # nothing of the disks left to the pause
    assert precopy & libvirt.VIR_MIGRATE_AUTO_CONVERGE and not precopy & libvirt.VIR_MIGRATE_POSTCOPY
    assert postcopy & libvirt.VIR_MIGRATE_POSTCOPY and not postcopy & libvirt.VIR_MIGRATE_AUTO_CONVERGE


def test_qemu_gets_half_the_pause_budget_for_its_copy_the_rest_is_for_the_switchover_around_it():
    from capsule.migrate.live import qemu_downtime_ms

    assert qemu_downtime_ms(1.0) == 500 and qemu_downtime_ms(0.2) == 100 and qemu_downtime_ms(0.001) == 1


def test_a_broken_links_cause_recorded_after_libvirt_gave_up_still_reaches_the_message():
    """libvirt can report its ended stream before the tunnel's thread has recorded why the link broke: the
    failure waits a moment for the cause instead of saying nothing of the link."""
    import threading
    from types import SimpleNamespace

    errors: list[str] = []
    tunnels = SimpleNamespace(tunnels={"memory": SimpleNamespace(errors=errors)})
    threading.Timer(0.3, lambda: errors.append("the peer cut the stream: destination disk full")).start()
    assert live._tunnel_errors(tunnels, settle=5.0) == ["the peer cut the stream: destination disk full"]
    assert live._tunnel_errors(SimpleNamespace(tunnels={}), settle=0.2) == []


def test_a_capsule_a_live_move_is_bringing_here_is_arriving_not_crashed(home, tmp_path, monkeypatch):  # noqa: F811
    """The destination of a live move holds the instance prepare made before libvirt's incoming domain exists:
    its lists say the capsule is arriving, not that it crashed; once the mark is gone, a missing domain is a
    crash again."""
    from capsule import capsules

    monkeypatch.setattr(capsules, "lookup_domain", lambda name: None)
    client = TestClient(create_app(home, TOKEN))     # (at its start an agent removes unfinished moves)
    sign_in(client)
    d = _half_moved(home, tmp_path, "b" * 32)

    def state() -> str:
        return {c["name"]: c["state"] for c in client.get("/api/capsules").json()}[SECRET]

    assert state() == "arriving"
    (d / incoming.MARK).unlink()
    assert state() == "crashed"


def test_auto_converge_starts_harder_than_qemus_defaults_and_post_copy_is_not_throttled():
    import libvirt

    from capsule.migrate.live import Routes, migrate_params

    route = Routes("qemu+unix:///system?socket=/x", "unix:///m", "unix:///d")
    prep = {"xml": "<domain/>", "domain": "capsule-s-c"}
    precopy, postcopy = migrate_params(route, prep, ["vda"], False), migrate_params(route, prep, ["vda"], True)
    for params in (precopy, postcopy):
        assert params[libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS] == ["vda"]
        assert params[libvirt.VIR_MIGRATE_PARAM_URI] == "unix:///m"
        assert params[libvirt.VIR_MIGRATE_PARAM_DISKS_URI] == "unix:///d"
    # QEMU's own 20 % then +10 % took 23 rounds to catch a 2 MiB/s writer on an 8 Mbit/s link
    assert precopy[libvirt.VIR_MIGRATE_PARAM_AUTO_CONVERGE_INITIAL] >= 40
    assert precopy[libvirt.VIR_MIGRATE_PARAM_AUTO_CONVERGE_INCREMENT] >= 20
    assert libvirt.VIR_MIGRATE_PARAM_AUTO_CONVERGE_INITIAL not in postcopy


def test_the_pause_reads_in_words_when_libvirt_did_not_report_it():
    """After a post-copy that lost its link and was resumed, the other host's completed job has no downtime:
    the move's last line says so instead of 'paused None ms'."""
    from capsule.migrate.jobwatch import LiveFigures

    assert LiveFigures(pause_ms=812).pause_text() == "paused 812 ms"
    resumed = LiveFigures(postcopy=True, link_breaks=1).pause_text()
    assert "None" not in resumed and "resumed post-copy" in resumed
    assert "None" not in LiveFigures().pause_text()


@pytest.mark.parametrize("bad", [-1, 2**70, True, 1.5, float("nan"), "812", None])
def test_the_other_hosts_figures_are_taken_only_within_their_bounds(bad):
    """The completed job's figures come from the network: out of bounds, each is left out."""
    from capsule.migrate.jobwatch import LiveFigures

    events = []
    tracker = Tracker("vm", "office", planned("live", False), events.append, min_interval=0)
    good = LiveFigures()
    live.take_reported({"downtime_ms": 812, "job": {"memory_processed": 5 << 20, "disk_processed": 7,
                                                   "memory_iteration": 3}}, good, tracker)
    assert (good.pause_ms, good.memory_bytes, good.disk_bytes, good.rounds) == (812, 5 << 20, 7, 3)
    assert events[-1].pause_ms == 812
    figures = LiveFigures(memory_bytes=10, rounds=2)
    live.take_reported({"downtime_ms": bad, "job": {"memory_processed": bad, "disk_processed": bad,
                                                    "memory_iteration": bad}}, figures, tracker)
    assert (figures.pause_ms, figures.memory_bytes, figures.disk_bytes, figures.rounds) == (None, 10, 0, 2)
    live.take_reported({"job": ["not", "a", "dict"]}, figures, tracker)
    assert figures.memory_bytes == 10
