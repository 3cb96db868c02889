"""A peer's capsule's clipboard and screen size through this agent (``capsule.console.peerclip``): the console
box of a console relayed from a peer (a capsule that moved there, its console following it) sets and reads the
guest's clipboard there, and the panel's size sets its screen's. This agent asks the peer's routes with its token
for the peer; the peer is a real agent app on uvicorn in a thread (over HTTP and TLS), its capsule's guest agent a
fake that plays the guest's X helper. A text over the limit is refused here and never reaches the peer; the peer's
refusals come back as its own."""

from __future__ import annotations

import pytest

from capsule.console import clipboard
from tests.unit.test_clipboard_api import FakeDesktop
from tests.unit.test_console_relay import client, peer  # noqa: F401 - fixtures: this host, and home (its peer)
from tests.unit.test_dashboard_api import sign_in

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

URL = "/api/hosts/home/capsules/desk/clipboard"


@pytest.fixture
def guest(tmp_path, peer):  # noqa: F811
    g = FakeDesktop(tmp_path / "inst-b" / "agent.sock")
    yield g
    g.listener.close()


def test_a_text_goes_to_the_peers_guest_and_back(client, guest):  # noqa: F811
    h = {"X-CSRF-Token": sign_in(client)}
    text = "über den Umzug hinaus 🙂"
    r = client.put(URL, json={"text": text}, headers=h)
    assert r.status_code == 200, r.text
    assert r.json() == {"bytes": len(text.encode()), "max_bytes": clipboard.MAX_BYTES}
    assert guest.clipboard == text.encode()
    guest.clipboard = b"from the guest there\n"
    r = client.get(URL)
    assert r.status_code == 200, r.text
    assert r.json() == {"text": "from the guest there\n", "bytes": 21, "max_bytes": clipboard.MAX_BYTES}


def test_refusals_here_and_there_change_nothing(client, guest):  # noqa: F811
    h = {"X-CSRF-Token": sign_in(client)}
    guest.clipboard = b"kept"
    r = client.put(URL, json={"text": "x" * (clipboard.MAX_BYTES + 1)}, headers=h)
    assert r.status_code == 413 and "512 KiB" in r.json()["detail"]
    assert guest.argvs == [] and guest.clipboard == b"kept"          # refused here: the peer was not asked
    assert client.put(URL, json={"text": "y"}).status_code == 403    # no CSRF token: a change needs it
    r = client.put("/api/hosts/nowhere/capsules/desk/clipboard", json={"text": "y"}, headers=h)
    assert r.status_code == 404 and "nowhere" in r.json()["detail"]
    r = client.get("/api/hosts/home/capsules/off/clipboard")          # the peer's own refusal: not running there
    assert r.status_code == 409 and "not running" in r.json()["detail"]
    assert guest.argvs == [] and guest.clipboard == b"kept"


def test_the_peers_guest_screen_follows_a_relayed_console(client, guest):  # noqa: F811
    """A console relayed from a peer follows the panel's size too: the peer's guest is set to it (bounded and
    rounded there), through this agent with its token for the peer."""
    h = {"X-CSRF-Token": sign_in(client)}
    r = client.put("/api/hosts/home/capsules/desk/screen-size", json={"width": 1250, "height": 700}, headers=h)
    assert r.status_code == 200, r.text
    assert r.json() == {"width": 1248, "height": 700} and guest.screen == (1248, 700)    # a multiple of 16, there
    assert client.put("/api/hosts/home/capsules/desk/screen-size", json={"width": 800, "height": 600}).status_code \
        == 403                                                                          # no CSRF token
    r = client.put("/api/hosts/home/capsules/desk/screen-size", json={"width": 0, "height": 600}, headers=h)
    assert r.status_code == 400 and "1 to 16384" in r.json()["detail"]                  # the peer's own refusal
    r = client.put("/api/hosts/nowhere/capsules/desk/screen-size", json={"width": 800, "height": 600}, headers=h)
    assert r.status_code == 404 and "nowhere" in r.json()["detail"]
    assert guest.screen == (1248, 700)
