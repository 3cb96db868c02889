"""The agent (root) opens what a guest's QEMU made only when it is what QEMU makes (capsule/runtime/guestfiles.py):
a ``vnc.sock`` that is a symbolic link to another socket, or a socket of another owner, is refused through the
agent's console API (no ticket, no WebSocket), and so is a serial console that is not the guest user's pty;
the guest agent's socket is never reached through a link either. Real sockets and ptys, made by the test."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from capsule import capsules
from capsule.agent.app import create_app
from capsule.console import screen
from capsule.lifecycle.memimage import VNC_SOCKET
from capsule.runtime import guestfiles
from capsule.runtime.guestaccess import guest_user
from capsule.runtime.guestagent import GuestAgent
from capsule.store import Store
from capsule.store.catalogue import InstanceRow
from tests.unit.test_console_api import EchoServer, refused
from tests.unit.test_dashboard_api import TOKEN, _fake_image, sign_in

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Listener:
    """A unix socket listening at ``path`` that counts the connections it was given."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.sock.setblocking(False)

    def connections(self) -> int:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1


@pytest.fixture
def home(tmp_path):
    """A store with capsule ``desk`` running (its instance directory at inst/desk)."""
    store = Store.open(tmp_path / "a")
    _fake_image(store)
    capsules.create(store, "desk", "img", memory="256M")
    inst = tmp_path / "inst" / "desk"
    inst.mkdir(parents=True)
    store.catalogue.add_instance(InstanceRow(capsule="desk", version=1, domain="d-desk", leaves=[], chains=[],
                                             accel="tcg", dir=str(inst)))
    store.close()
    return tmp_path


@pytest.fixture
def web(home):
    return TestClient(create_app(home / "a", TOKEN))


def ask_ticket(web: TestClient, csrf: str, name: str, kind: str = "screen"):
    return web.post(f"/api/capsules/{name}/console-ticket?kind={kind}", headers={"X-CSRF-Token": csrf})


@pytest.fixture
def elsewhere(tmp_path):
    """Another root socket on this host (standing in for libvirt's), outside any instance directory."""
    (tmp_path / "run").mkdir()
    other = Listener(tmp_path / "run" / "libvirt-sock")
    yield other
    other.sock.close()


def test_a_screen_socket_that_is_a_link_to_another_socket_is_refused(web, home, elsewhere):
    os.symlink(elsewhere.sock.getsockname(), home / "inst" / "desk" / VNC_SOCKET)
    csrf = sign_in(web)
    r = ask_ticket(web, csrf, "desk")
    assert r.status_code == 409 and r.json()["error"] == "guest_file_refused", r.text
    assert "symbolic link" in r.json()["detail"]
    assert elsewhere.connections() == 0


def test_a_screen_socket_swapped_for_a_link_after_the_ticket_is_not_followed(web, home, elsewhere):
    sock = home / "inst" / "desk" / VNC_SOCKET
    server = EchoServer(sock)
    csrf = sign_in(web)
    t = ask_ticket(web, csrf, "desk").json()["ticket"]
    sock.unlink()                       # QEMU swaps its socket for a link after the ticket was given
    os.symlink(elsewhere.sock.getsockname(), sock)
    assert refused(web, f"/api/console/desk?ticket={t}") == 409
    assert elsewhere.connections() == 0
    server.stop()


def test_a_screen_socket_of_another_owner_is_refused(web, home):
    sock = home / "inst" / "desk" / VNC_SOCKET
    server = EchoServer(sock)
    os.chown(sock, 0, 0)                # a hard link to a root socket would look like this
    try:
        csrf = sign_in(web)
        r = ask_ticket(web, csrf, "desk")
        assert r.status_code == 409 and "belongs to uid 0" in r.json()["detail"], r.text
        os.chown(sock, 65534, 65534)    # nobody
        assert "belongs to uid 65534" in ask_ticket(web, csrf, "desk").json()["detail"]
        os.chown(sock, guest_user().uid, guest_user().gid)
        t = ask_ticket(web, csrf, "desk").json()["ticket"]
        with web.websocket_connect(f"/api/console/desk?ticket={t}") as ws:   # the guest user's: it works
            assert ws.receive_bytes() == b"RFB 003.008\n"
    finally:
        server.stop()


def test_connect_socket_refuses_links_and_other_kinds(tmp_path, elsewhere):
    os.symlink(elsewhere.sock.getsockname(), tmp_path / "link.sock")
    with pytest.raises(guestfiles.GuestFileRefused, match="symbolic link"):
        guestfiles.connect_socket(tmp_path / "link.sock", root_too=True)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(guestfiles.GuestFileRefused, match="not a socket"):
        guestfiles.connect_socket(tmp_path / "file", root_too=True)
    with pytest.raises(FileNotFoundError):
        guestfiles.connect_socket(tmp_path / "none")
    guestfiles.connect_socket(Path(elsewhere.sock.getsockname()), root_too=True).close()
    assert elsewhere.connections() == 1


def test_the_guest_agent_socket_is_never_reached_through_a_link(tmp_path, elsewhere):
    os.symlink(elsewhere.sock.getsockname(), tmp_path / "agent.sock")
    with pytest.raises(guestfiles.GuestFileRefused, match="symbolic link"):
        GuestAgent(tmp_path / "agent.sock", timeout=1)
    assert elsewhere.connections() == 0


@pytest.fixture
def pty():
    master, slave = os.openpty()
    os.fchown(slave, guest_user().uid, -1)
    yield Path(os.ttyname(slave)), master
    os.close(master)
    os.close(slave)


def serial_at(monkeypatch, home: Path, path: Path) -> None:
    monkeypatch.setattr(screen, "serial_console",
                        lambda store, name: screen.Serial(path, home / "inst" / "desk" / "console.log"))


def serial_ticket_refused(web: TestClient) -> int:
    csrf = sign_in(web)
    t = ask_ticket(web, csrf, "desk", "serial").json()
    return refused(web, t["url"])


def test_a_serial_console_that_is_not_the_guest_users_pty_is_refused(web, home, pty, monkeypatch,
                                                                      tmp_path):
    path, master = pty
    link = tmp_path / "pts-link"
    os.symlink(path, link)
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:x:\n")
    for where in (link, secret, Path("/dev/null"), Path("/dev/pts/../../etc/passwd")):
        serial_at(monkeypatch, home, where)
        assert serial_ticket_refused(web) == 409, where
    assert secret.read_bytes() == b"root:x:\n"
    os.chown(path, 0, -1)               # another user's terminal (an admin's shell)
    serial_at(monkeypatch, home, path)
    assert serial_ticket_refused(web) == 409
    os.chown(path, guest_user().uid, -1)
    fd = guestfiles.open_pty(path)      # the guest user's pty opens
    os.write(fd, b"hi")
    os.close(fd)
    assert os.read(master, 10) == b"hi"
