"""A post-copy whose link breaks: the source resumes it when the link returns, else gives up within its recover
timeout (capsule/migrate/recover.py); the destination removes its stranded half once its own wait is over, and
never adopts it as a running guest (capsule/exchange/stranded.py, capsule/exchange/incoming.py). libvirt's domains
are stand-ins here; tests/hosts/test_live_migrate.py cuts a real link during a real post-copy."""

from __future__ import annotations

import json
import threading

import libvirt
import pytest

from capsule.agent.app import create_app
from capsule.errors import RuntimeFailure
from capsule.exchange import incoming, stranded
from capsule.migrate import recover
from capsule.store import Store
from tests.unit.test_dashboard_api import SECRET, TOKEN, home  # noqa: F401 - fixture
from tests.unit.test_live_move import _half_moved

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

FAILED_THERE = (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_POSTCOPY_FAILED)
FAILED_HERE = (libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_POSTCOPY_FAILED)


class Domain:
    """A libvirt domain's stand-in: its state, and what was done to it."""

    def __init__(self, state: tuple[int, int], resumes: list[bool] | None = None) -> None:
        self.now = state
        self.destroyed = False
        self.resumes = list(resumes or [])     # each resume attempt's outcome, in order
        self.attempts: list[int] = []
        self.interrupted = 0

    def state(self):
        return self.now

    def isActive(self):
        return not self.destroyed

    def destroy(self):
        self.destroyed = True

    def migrateToURI3(self, uri, params, flags):
        self.attempts.append(flags)
        if not (self.resumes.pop(0) if self.resumes else False):
            raise libvirt.libvirtError("unable to connect to the destination")
        self.now = (libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED)

    def abortJobFlags(self, flags):
        self.interrupted += 1


def _moves(where) -> list[str]:
    store = Store.open(where)
    try:
        return [i.capsule for i, _m in incoming.unfinished(store)]
    finally:
        store.close()


def _mark(d) -> dict:
    return json.loads((d / incoming.MARK).read_text())


def test_a_stranded_half_waits_the_sources_timeout_and_its_margin_then_goes(home, tmp_path, monkeypatch):  # noqa: F811
    d = _half_moved(home, tmp_path, "d" * 32)
    mark = _mark(d) | {"recover_timeout": 20}
    (d / incoming.MARK).write_text(json.dumps(mark))
    dom = Domain(FAILED_THERE)
    monkeypatch.setattr(stranded, "lookup_domain", lambda _name: dom)
    monkeypatch.setattr(incoming, "lookup_domain", lambda _name: dom)
    store = Store.open(home)
    try:
        assert stranded.tick(store, now=1000.0) == [] and _mark(d)[stranded.SINCE] == 1000.0
        # within the source's 20 s and the margin: kept, its source may still resume it
        assert stranded.tick(store, now=1000.0 + 20 + stranded.MARGIN - 1) == [] and d.exists()
        assert not dom.destroyed
        for bad in (float("nan"), 10**12):        # a mark that makes no sense starts the wait again, never ends it
            (d / incoming.MARK).write_text(json.dumps(_mark(d) | {stranded.SINCE: bad}))
            assert stranded.tick(store, now=5000.0) == [] and _mark(d)[stranded.SINCE] == 5000.0
        (d / incoming.MARK).write_text(json.dumps(_mark(d) | {stranded.SINCE: 1000.0}))
        assert stranded.tick(store, now=1000.0 + 20 + stranded.MARGIN + 1) == [SECRET]
        assert dom.destroyed and not d.exists() and store.catalogue.instance(SECRET) is None
    finally:
        store.close()


def test_a_half_whose_post_copy_resumed_is_left_alone_and_waits_anew_at_its_next_break(home, tmp_path,  # noqa: F811
                                                                                        monkeypatch):
    d = _half_moved(home, tmp_path, "e" * 32)
    dom = Domain(FAILED_THERE)
    monkeypatch.setattr(stranded, "lookup_domain", lambda _name: dom)
    store = Store.open(home)
    try:
        stranded.tick(store, now=1000.0)
        dom.now = (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_POSTCOPY)   # the link came back
        assert stranded.tick(store, now=5000.0) == [] and stranded.SINCE not in _mark(d)
        dom.now = FAILED_THERE                                                         # and broke again
        assert stranded.tick(store, now=5001.0) == [] and _mark(d)[stranded.SINCE] == 5001.0
        assert d.exists() and not dom.destroyed
        # a malformed or missing timeout in the mark: the default wait, never none
        assert stranded.wait_of({"recover_timeout": "soon"}) == stranded.DEFAULT_RECOVER + stranded.MARGIN
        assert stranded.wait_of({"recover_timeout": -5}) == stranded.DEFAULT_RECOVER + stranded.MARGIN
    finally:
        store.close()


def test_a_stranded_half_is_never_adopted_as_a_running_guest_when_its_session_ends(home, tmp_path,  # noqa: F811
                                                                                   monkeypatch):
    """The agent starts again (its tunnel sessions are gone: the post-copy cannot resume): a half that lacks pages
    only its source holds is removed, where a guest that arrived whole is kept (test_live_move)."""
    for i, state in enumerate((FAILED_THERE, (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_POSTCOPY))):
        (tmp_path / str(i)).mkdir()
        d = _half_moved(home, tmp_path / str(i), "f" * 32)
        dom = Domain(state)
        monkeypatch.setattr(incoming, "lookup_domain", lambda _name, dom=dom: dom)
        create_app(home, TOKEN)
        assert dom.destroyed and not d.exists() and _moves(home) == [], state


def test_the_prepare_request_bounds_the_recover_timeout(home):  # noqa: F811
    store = Store.open(home)
    try:
        for bad in (float("nan"), -1, 10**6, "1"):
            with pytest.raises(Exception, match="recover_timeout"):
                incoming.prepare(store, {"capsule": SECRET, "version": 1, "xml": "", "disks": [],
                                         "recover_timeout": bad})
    finally:
        store.close()


def _resume(dom: Domain, timeout: float, said: list[str]):
    def watch(worker: threading.Thread, errors: list[BaseException]) -> str:
        worker.join()
        return "figures"
    return recover.resume(dom, lambda: dom.migrateToURI3("uri", {}, libvirt.VIR_MIGRATE_POSTCOPY),
                          timeout=timeout, say=said.append, watch=watch, retry=0.01)


def test_a_post_copy_is_tried_again_until_the_link_returns():
    dom = Domain(FAILED_HERE, resumes=[False, False, True])
    said: list[str] = []
    assert _resume(dom, 30, said) == "figures"
    assert len(dom.attempts) == 3
    assert said[-1] == "the post-copy resumed after 3 attempts"


def test_a_link_that_does_not_return_in_time_is_given_up_with_the_last_reason():
    dom = Domain(FAILED_HERE)
    with pytest.raises(recover.PostcopyLost, match=r"did not return within 0 s .*unable to connect"):
        _resume(dom, 0.3, [])
    assert dom.attempts


def test_a_guest_no_longer_waiting_for_its_post_copy_is_not_resumed():
    dom = Domain((libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_DESTROYED))
    with pytest.raises(RuntimeFailure, match="no longer waiting"):
        _resume(dom, 30, [])
    assert dom.attempts == []


def _hanging(dom: Domain) -> threading.Event:
    """``dom``'s tries hang until the event is set (a link that half works), then fail."""
    release = threading.Event()

    def hangs(uri, params, flags):
        dom.attempts.append(flags)
        release.wait(10)
        raise libvirt.libvirtError("paused again")

    dom.migrateToURI3 = hangs  # type: ignore[method-assign]
    return release


def test_an_attempt_still_under_way_at_the_deadline_is_interrupted():
    dom = Domain(FAILED_HERE)
    release = _hanging(dom)
    dom.abortJobFlags = lambda flags: (release.set(), setattr(dom, "interrupted", dom.interrupted + 1))  # type: ignore
    with pytest.raises(recover.PostcopyLost):
        _resume(dom, 0.5, [])
    assert dom.interrupted == 1 and len(dom.attempts) == 1


def _qmp_script(monkeypatch, replies: list[object]) -> list[tuple[str, dict]]:
    """recover.attempt's QMP commands, answered from ``replies`` in order (an exception is raised)."""
    sent: list[tuple[str, dict]] = []

    def command(dom, cmd, **args):
        sent.append((cmd, args))
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    monkeypatch.setattr(recover.qmp, "command", command)
    return sent


def test_a_try_asks_the_other_host_first_then_resumes_through_the_tunnel_entrance(monkeypatch):
    sent = _qmp_script(monkeypatch, [{}, {"status": "postcopy-recover"}, {"status": "postcopy-active"},
                                     {"status": "completed"}])
    asked: list[str] = []
    recover.attempt(Domain(FAILED_HERE), "unix:///run/tunnel/x/qemu-migration.sock",
                    lambda: asked.append("listen"), lambda _m: None, poll=0)
    assert asked == ["listen"]
    assert sent[0] == ("migrate", {"uri": "unix:/run/tunnel/x/qemu-migration.sock", "resume": True})
    assert [c for c, _a in sent[1:]] == ["query-migrate"] * 3


def test_a_try_whose_link_breaks_again_fails_and_one_libvirt_ended_as_migrated_succeeds(monkeypatch):
    _qmp_script(monkeypatch, [{}, {"status": "postcopy-active"}, {"status": "postcopy-paused"}])
    with pytest.raises(RuntimeFailure, match="stopped again: .* postcopy-paused"):
        recover.attempt(Domain(FAILED_HERE), "unix:///p", lambda: None, lambda _m: None, poll=0)
    gone = Domain(FAILED_HERE)
    gone.destroyed = True                        # libvirt stopped the source once the migration completed
    _qmp_script(monkeypatch, [{}, RuntimeFailure("QEMU query-migrate: domain is not running")])
    recover.attempt(gone, "unix:///p", lambda: None, lambda _m: None, poll=0)


def test_a_try_the_other_host_refuses_never_touches_qemu_here(monkeypatch):
    sent = _qmp_script(monkeypatch, [])

    def refuse() -> None:
        raise RuntimeFailure("the other host does not answer")

    with pytest.raises(RuntimeFailure, match="does not answer"):
        recover.attempt(Domain(FAILED_HERE), "unix:///p", refuse, lambda _m: None, poll=0)
    assert sent == []


def test_the_recover_route_listens_only_for_a_stranded_half_through_the_callers_own_session(tmp_path, monkeypatch):
    """``POST /v1/live/{id}/recover``: QEMU listens again at the session's own migration socket (never a path from
    the request), only for the token that opened the session, only for a half whose post-copy lost its link."""
    from fastapi.testclient import TestClient

    from tests.helpers.inprocess_agent import InProcessAgent
    from tests.unit.test_dashboard_api import PEER_TOKEN
    from tests.unit.test_live_move import _half_moved

    monkeypatch.setenv("CAPSULE_TUNNEL_DIR", str(tmp_path / "tunnel"))
    agent = InProcessAgent(tmp_path / "b", PEER_TOKEN)
    try:
        client = TestClient(agent.app)
        auth = {"Authorization": f"Bearer {PEER_TOKEN}"}
        opened = client.post("/v1/tunnel", json={"kinds": ["qemu-migration"]}, headers=auth).json()
        d = _half_moved(tmp_path / "b", tmp_path, opened["session"])
        dom = Domain(FAILED_THERE)
        monkeypatch.setattr(incoming, "lookup_domain", lambda _name: dom)
        sent: list[tuple[str, dict]] = []
        monkeypatch.setattr(incoming.qmp, "over_socket", lambda path, cmd, **args: sent.append((cmd, args)) or {})
        url = "/v1/live/" + "a" * 32 + "/recover"
        r = client.post(url, headers=auth)                 # a half that arrived without its own monitor
        assert r.status_code == 409 and "without a monitor" in r.json()["detail"] and sent == []
        (d / incoming.qmp.MONITOR).touch()
        r = client.post(url, json={"uri": "unix:/etc/evil"}, headers=auth)
        assert r.status_code == 200, r.text
        assert sent == [("migrate-recover", {"uri": f"unix:{opened['channels']['qemu-migration']['path']}"})]
        dom.now = (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_POSTCOPY)      # not stranded
        r = client.post(url, headers=auth)
        assert r.status_code == 409 and "not a post-copy waiting" in r.json()["detail"]
        dom.now = FAILED_THERE
        monkeypatch.setattr(incoming, "sweep_quietly", lambda *a, **k: None)   # (the half stays, to be asked)
        client.delete(f"/v1/tunnel/{opened['session']}", headers=auth)
        r = client.post(url, headers=auth)                                 # its session ended: it cannot resume
        assert r.status_code == 404 and "tunnel session" in r.json()["detail"] and len(sent) == 1, r.text
        assert client.post("/v1/live/xyz/recover", headers=auth).status_code == 400
    finally:
        agent.stop()


def test_an_arriving_guests_own_monitor_is_accepted_on_a_later_restore_and_never_kept(tmp_path):
    """The destination's XML carries a QMP monitor of its own (qmp.with_monitor); when that guest is suspended or
    moves on, its XML is checked and rebuilt from the template like any other: the monitor is let through and
    dropped, where any other QEMU argument is refused (tests/unit/test_restorexml.py)."""
    from capsule.runtime import qmp, restorexml
    from tests.unit.test_restorexml import SAVED

    path = tmp_path / "instances" / "x" / qmp.MONITOR
    xml = qmp.with_monitor(SAVED, path)
    assert f"unix:{path},server=on,wait=off" in xml and "-qmp" in xml
    restorexml.check(xml)
    assert qmp.with_monitor(SAVED, tmp_path / ("x" * 120)) == SAVED      # too long for a socket: none
    other = xml.replace("-qmp", "-fw_cfg")
    with pytest.raises(Exception, match="qemu:"):
        restorexml.check(other)


def test_a_monitor_of_its_own_is_spoken_to_as_qmp_events_skipped_errors_named(tmp_path):
    import socket

    from capsule.runtime import qmp

    path = tmp_path / "m.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(2)
    heard: list[dict] = []

    def serve(answers: list[dict], capabilities: str = "[]") -> None:
        conn, _ = server.accept()
        with conn, conn.makefile("rwb") as f:
            f.write(b'{"QMP": {"version": {}, "capabilities": ' + capabilities.encode() + b'}}\n')
            f.flush()
            for answer in answers:
                heard.append(json.loads(f.readline()))
                f.write(b'{"event": "MIGRATION", "data": {"status": "setup"}}\n' + json.dumps(answer).encode() + b"\n")
                f.flush()

    t = threading.Thread(target=serve, args=([{"return": {}}, {"return": {"ok": 1}}],))
    t.start()
    assert qmp.over_socket(path, "migrate-recover", uri="unix:/x") == {"ok": 1}
    t.join(5)
    assert heard == [{"execute": "qmp_capabilities"}, {"execute": "migrate-recover", "arguments": {"uri": "unix:/x"}}]
    t = threading.Thread(target=serve, args=([{"return": {}}, {"error": {"class": "GenericError",
                                                                      "desc": "postcopy is not paused"}}],))
    t.start()
    with pytest.raises(RuntimeFailure, match="migrate-recover: postcopy is not paused"):
        qmp.over_socket(path, "migrate-recover", uri="unix:/x")
    t.join(5)
    # a monitor that offers out-of-band execution: it is enabled, and the command runs out of band (QEMU runs it
    # even while its main loop is blocked, as a post-copy that lost its link can leave it)
    heard.clear()
    t = threading.Thread(target=serve, args=([{"return": {}}, {"return": {}, "id": "capsule"}], '["oob"]'))
    t.start()
    assert qmp.over_socket(path, "migrate-recover", uri="unix:/x") == {}
    t.join(5)
    assert heard == [{"execute": "qmp_capabilities", "arguments": {"enable": ["oob"]}},
                     {"exec-oob": "migrate-recover", "id": "capsule", "arguments": {"uri": "unix:/x"}}]
    server.close()
    with pytest.raises(RuntimeFailure, match="does not answer"):
        qmp.over_socket(path, "migrate-recover", timeout=1)


def test_a_try_libvirt_will_not_interrupt_is_paused_by_qemu_itself(monkeypatch):
    """The try was QEMU's (a QMP ``migrate`` with ``resume``): libvirt may refuse to abort it as its job."""
    dom = Domain(FAILED_HERE)
    release = _hanging(dom)

    def refuses(flags):
        raise libvirt.libvirtError("no job to abort")

    dom.abortJobFlags = refuses  # type: ignore[method-assign]
    sent: list[str] = []
    monkeypatch.setattr(recover.qmp, "command", lambda _d, cmd, **a: (sent.append(cmd), release.set()))
    with pytest.raises(recover.PostcopyLost):
        _resume(dom, 0.5, [])
    assert sent == ["migrate-pause"] and len(dom.attempts) == 1
