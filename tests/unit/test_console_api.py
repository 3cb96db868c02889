"""The live console's tickets and splice on a real agent app, without guests: a fake VNC server (a unix-socket
echo server in a thread) stands where QEMU's is. A ticket opens one capsule's console once, within its
lifetime, for the session that asked; without a session the handshake is 401."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from capsule import audit, capsules
from capsule.agent.app import create_app
from capsule.console import screen
from capsule.console.routes import Tickets
from capsule.lifecycle.memimage import VNC_SOCKET
from capsule.runtime.guestaccess import guest_user
from capsule.store import Store
from capsule.store.catalogue import InstanceRow
from tests.unit.test_dashboard_api import TOKEN, Clock, _fake_image, sign_in

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class EchoServer:
    """A unix socket that sends a greeting, then echoes every byte back upper-cased (so the test sees that the
    bytes went through the server, not just back through the splice)."""

    def __init__(self, path: Path) -> None:
        self.hang_up = threading.Event()   # set: close the connection after the next echo
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        os.chown(path, guest_user().uid, guest_user().gid)   # QEMU makes it, as the guest user
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.sendall(b"RFB 003.008\n")
            while data := conn.recv(4096):
                conn.sendall(data.upper())
                if self.hang_up.is_set():
                    break
        self.closed.set()

    def stop(self) -> None:
        self.sock.close()


@pytest.fixture
def home(tmp_path):
    store = Store.open(tmp_path / "a")
    _fake_image(store)
    for name in ("desk", "other", "off"):
        capsules.create(store, name, "img", memory="256M")
    for name in ("desk", "other"):
        inst = tmp_path / "inst" / name
        inst.mkdir(parents=True)
        store.catalogue.add_instance(InstanceRow(capsule=name, version=1, domain=f"d-{name}", leaves=[],
                                                 chains=[], accel="tcg", dir=str(inst)))
    store.close()
    return tmp_path


@pytest.fixture
def servers(home):
    s = {name: EchoServer(home / "inst" / name / VNC_SOCKET) for name in ("desk", "other")}
    yield s
    for server in s.values():
        server.stop()


@pytest.fixture
def app(home):
    app = create_app(home / "a", TOKEN)
    app.state.sessions.clock = Clock()
    app.state.console_tickets.clock = Clock()
    return app


@pytest.fixture
def client(app):
    return TestClient(app)


def ticket(client: TestClient, csrf: str, name: str) -> str:
    r = client.post(f"/api/capsules/{name}/console-ticket", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["url"] == f"/api/console/{name}?ticket={body['ticket']}" and body["expires_in"] == 30
    return body["ticket"]


def refused(client: TestClient, url: str) -> int:
    with pytest.raises(WebSocketDenialResponse) as info, client.websocket_connect(url):
        pass
    return info.value.status_code


def test_bytes_go_both_ways_and_both_ends_close(client, servers):
    csrf = sign_in(client)
    t = ticket(client, csrf, "desk")
    with client.websocket_connect(f"/api/console/desk?ticket={t}", subprotocols=["binary"]) as ws:
        assert ws.accepted_subprotocol == "binary"
        assert ws.receive_bytes() == b"RFB 003.008\n"
        ws.send_bytes(b"hello vnc")
        assert ws.receive_bytes() == b"HELLO VNC"
        ws.send_bytes(bytes(range(256)) * 64)
        got = b""
        while len(got) < 256 * 64:
            got += ws.receive_bytes()
        assert got == (bytes(range(256)) * 64).upper()
    # the page closed its end: the agent closed the socket to the VNC server
    assert servers["desk"].closed.wait(10)
    assert not servers["other"].closed.is_set()


def test_server_hanging_up_closes_the_websocket(client, servers):
    csrf = sign_in(client)
    t = ticket(client, csrf, "desk")
    with client.websocket_connect(f"/api/console/desk?ticket={t}") as ws:
        assert ws.receive_bytes() == b"RFB 003.008\n"
        servers["desk"].hang_up.set()
        ws.send_bytes(b"bye")
        assert ws.receive_bytes() == b"BYE"
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_bytes()
        assert info.value.code == 1000


def test_ticket_is_single_use(client, servers):
    csrf = sign_in(client)
    t = ticket(client, csrf, "desk")
    with client.websocket_connect(f"/api/console/desk?ticket={t}") as ws:
        assert ws.receive_bytes() == b"RFB 003.008\n"
    assert refused(client, f"/api/console/desk?ticket={t}") == 403


def test_ticket_expires(client, app, servers):
    csrf = sign_in(client)
    t = ticket(client, csrf, "desk")
    app.state.console_tickets.clock.now += 31
    assert refused(client, f"/api/console/desk?ticket={t}") == 403


def test_ticket_for_one_capsule_does_not_open_another(client, servers):
    csrf = sign_in(client)
    t = ticket(client, csrf, "desk")
    assert refused(client, f"/api/console/other?ticket={t}") == 403
    # and the attempt used it up
    assert refused(client, f"/api/console/desk?ticket={t}") == 403
    assert not servers["other"].closed.is_set()


def test_no_session_is_401_even_with_a_ticket(client, app, servers):
    csrf = sign_in(client)
    t = ticket(client, csrf, "desk")
    anonymous = TestClient(app)
    assert refused(anonymous, f"/api/console/desk?ticket={t}") == 401
    r = anonymous.post("/api/capsules/desk/console-ticket")
    assert r.status_code == 401 and "desk" not in r.text


def test_ticket_belongs_to_the_session_that_asked(client, app, servers):
    csrf = sign_in(client)
    t = ticket(client, csrf, "desk")
    other = TestClient(app)
    sign_in(other)
    assert refused(other, f"/api/console/desk?ticket={t}") == 403


def test_ticket_needs_csrf_and_another_site_cannot_open(client, servers):
    sign_in(client)
    assert client.post("/api/capsules/desk/console-ticket").status_code == 403
    csrf = client.get("/api/session").json()["csrf"]
    t = ticket(client, csrf, "desk")
    with pytest.raises(WebSocketDenialResponse) as info, client.websocket_connect(
            f"/api/console/desk?ticket={t}", headers={"Origin": "https://evil.example"}):
        pass
    assert info.value.status_code == 403


def test_bearer_token_scripts(client, servers):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = client.post("/api/capsules/desk/console-ticket", headers=auth)
    t = r.json()["ticket"]
    with client.websocket_connect(f"/api/console/desk?ticket={t}", headers=auth) as ws:
        assert ws.receive_bytes() == b"RFB 003.008\n"


def test_no_ticket_for_a_stopped_unknown_or_screenless_capsule(client, home, servers):
    csrf = sign_in(client)
    h = {"X-CSRF-Token": csrf}
    r = client.post("/api/capsules/off/console-ticket", headers=h)
    assert r.status_code == 409 and "not running" in r.json()["detail"]
    assert client.post("/api/capsules/nope/console-ticket", headers=h).status_code == 404
    assert client.post("/api/capsules/..%2Fx/console-ticket", headers=h).status_code in (400, 404)
    (home / "inst" / "other" / VNC_SOCKET).unlink()  # restored from an image saved without a screen
    r = client.post("/api/capsules/other/console-ticket", headers=h)
    assert r.status_code == 409 and "no screen" in r.json()["detail"]


def test_tickets_unit():
    clock = Clock()
    tickets = Tickets(lifetime=30, clock=clock)
    a = tickets.issue("x", "s1")
    assert not tickets.redeem(a, "x", "s2")            # another session; and now it is used up
    assert not tickets.redeem(a, "x", "s1")
    b = tickets.issue("x", None)
    clock.now += 29.9
    assert tickets.redeem(b, "x", None)
    c = tickets.issue("x", None)
    clock.now += 30
    assert not tickets.redeem(c, "x", None)
    assert not tickets.redeem("made-up", "x", None)


def test_serial_console_shows_the_log_then_splices_the_pty(client, home, monkeypatch):
    """The guest's side of the serial port is a pty master held by the test."""
    master, slave = os.openpty()
    os.fchown(slave, guest_user().uid, -1)   # QEMU opens it, as the guest user
    log = home / "inst" / "desk" / "console.log"
    log.write_bytes(b"x" * 20000 + b"\nearlier boot output\n")
    monkeypatch.setattr(screen, "serial_console", lambda store, name: screen.Serial(Path(os.ttyname(slave)), log))
    try:
        csrf = sign_in(client)
        r = client.post("/api/capsules/desk/console-ticket?kind=serial", headers={"X-CSRF-Token": csrf})
        body = r.json()
        assert body["url"] == f"/api/console/desk/serial?ticket={body['ticket']}"
        # a serial ticket does not open the screen
        assert refused(client, f"/api/console/desk?ticket={body['ticket']}") == 403
        t = client.post("/api/capsules/desk/console-ticket?kind=serial", headers={"X-CSRF-Token": csrf}).json()
        with client.websocket_connect(t["url"]) as ws:
            history = ws.receive_bytes()
            assert history.endswith(b"earlier boot output\n") and len(history) <= 16 * 1024
            assert not history.startswith(b"x" * 100 + b"\n")
            ws.send_text("echo hi\r")
            got = b""
            while not got.endswith(b"hi\r"):
                got += os.read(master, 100)
            assert got == b"echo hi\r"
            os.write(master, b"hi\r\n# ")
            out = b""
            while not out.endswith(b"# "):
                out += ws.receive_bytes()
            assert out == b"hi\r\n# "
    finally:
        os.close(master)
        os.close(slave)


def test_console_tickets_and_opens_are_audited(client, app, home, servers):
    """Who asked for which capsule's console ticket, and who opened (or was refused) which console, from where."""
    csrf = sign_in(client)
    t = ticket(client, csrf, "desk")
    with client.websocket_connect(f"/api/console/desk?ticket={t}") as ws:
        assert ws.receive_bytes() == b"RFB 003.008\n"
    assert refused(client, f"/api/console/desk?ticket={t}") == 403            # used up
    assert refused(TestClient(app), "/api/console/other?ticket=x") == 401      # no session
    got = [(e["who"], e["action"], e["capsule"], e["from"], e["result"]) for e in audit.entries(home / "a")
           if "console" in e["action"]]
    assert got == [
        ("host-token", "POST /api/capsules/{name}/console-ticket", "desk", "testclient", "ok"),
        ("host-token", "WS /api/console/{name}", "desk", "testclient", "ok"),
        ("host-token", "WS /api/console/{name}", "desk", "testclient", "forbidden"),
        ("anonymous", "WS /api/console/{name}", None, "testclient", "auth_failed"),
    ]
