"""The clipboard and screen-size routes on a real agent app and store, with a fake guest agent on the capsule's
socket that plays the guest's X helper (``capsule.console.xsession``): a text set through the page is what the guest is
given, in exec requests within the agent's line limit, and what the guest holds comes back; a text over the
limit is refused either way with the clipboard's own error and nothing reaches the guest; an unknown or stopped
capsule, another owner's capsule, and a call without the session's CSRF token are refused. The screen size asked
for is brought within what the VGA card shows before the guest is asked (its width a multiple of 16, two frames
of it within the card's 16 MiB), and a size that is none is refused."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from capsule.accounts import owners, tokens, users
from capsule.agent.app import create_app
from capsule.console import clipboard, guestx
from capsule.store import Store
from tests.helpers.fakeagent import ExecAgent
from tests.unit.test_console_api import home  # noqa: F401 - fixture: capsules desk, other (running) and off
from tests.unit.test_dashboard_api import TOKEN, Clock, sign_in

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LINE_LIMIT = 65536     # the guest agent's longest request line (guest-balloon/PROTOCOL.md)


class FakeDesktop(ExecAgent):
    """A guest agent whose ``exec`` plays the guest: ``sh -c '... cat >[>] FILE'`` writes its stdin to FILE,
    ``python3 - set FILE`` (the helper on stdin) makes FILE's base64 the clipboard, ``python3 - get MAX`` answers it in
    base64 (exit 3 beyond MAX)."""

    def __init__(self, path: Path) -> None:
        self.files: dict[str, str] = {}
        self.clipboard = b""
        self.screen = (1280, 800)
        super().__init__(path, self.exec)

    def exec(self, argv: list[str], args: dict[str, Any]) -> dict[str, Any]:
        done = {"exit_code": 0, "stdout": "", "stderr": "", "timed_out": False}
        if argv[:2] == ["sh", "-c"]:
            m = re.fullmatch(r"(?:umask 077 && mkdir -p \S+ && )?cat (>>?) (/run/capsule-clipboard/[0-9a-f]+)", argv[2])
            assert m, argv
            self.files[m[2]] = (self.files.get(m[2], "") if m[1] == ">>" else "") + args.get("stdin", "")
            return done
        assert argv[:2] == ["python3", "-"] and args["stdin"] == guestx.HELPER
        if argv[2] == "size":
            self.screen = (int(argv[3]), int(argv[4]))
            return done | {"stdout": f"{argv[3]} {argv[4]}\n"}
        if argv[2] == "set":
            self.clipboard = base64.b64decode(self.files.pop(argv[3]))
            return done
        if len(self.clipboard) > int(argv[3]):
            return done | {"exit_code": 3, "stderr": "the guest's clipboard holds more than it may\n"}
        return done | {"stdout": base64.b64encode(self.clipboard).decode()}


@pytest.fixture
def guests(home):  # noqa: F811
    g = {name: FakeDesktop(home / "inst" / name / "agent.sock") for name in ("desk", "other")}
    yield g
    for guest in g.values():
        guest.listener.close()


@pytest.fixture
def client(home):  # noqa: F811
    app = create_app(home / "a", TOKEN)
    app.state.sessions.clock = Clock()
    return TestClient(app)


def test_a_text_goes_to_the_guest_and_back(client, guests):
    csrf = sign_in(client)
    text = "Grüße aus dem Büro, ß → ∑ 🙂\nzweite Zeile\ttab"
    r = client.put("/api/capsules/desk/clipboard", json={"text": text}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200, r.text
    assert r.json() == {"bytes": len(text.encode()), "max_bytes": clipboard.MAX_BYTES}
    assert guests["desk"].clipboard == text.encode() and guests["desk"].files == {}
    assert guests["other"].clipboard == b""
    guests["desk"].clipboard = "copied in the guest: ÿ".encode()      # the guest's user copies something
    r = client.get("/api/capsules/desk/clipboard")
    assert r.status_code == 200, r.text
    assert r.json() == {"text": "copied in the guest: ÿ", "bytes": 23, "max_bytes": clipboard.MAX_BYTES}
    assert r.headers["cache-control"] == "no-store"


def test_a_large_text_goes_in_pieces_within_the_agents_line_limit(client, guests):
    csrf = sign_in(client)
    text = "".join(chr(0x4E00 + i % 20000) for i in range(clipboard.MAX_BYTES // 3))   # 3 bytes a character
    r = client.put("/api/capsules/desk/clipboard", json={"text": text}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200, r.text
    assert guests["desk"].clipboard == text.encode()
    assert len([a for a in guests["desk"].argvs if a[0] == "sh"]) > 10
    assert guests["desk"].longest < LINE_LIMIT
    assert client.get("/api/capsules/desk/clipboard").json()["text"] == text


def test_too_large_is_refused_both_ways_and_nothing_reaches_the_guest(client, guests):
    csrf = sign_in(client)
    guests["desk"].clipboard = b"before"
    r = client.put("/api/capsules/desk/clipboard", json={"text": "x" * (clipboard.MAX_BYTES + 1)},
                   headers={"X-CSRF-Token": csrf})
    assert r.status_code == 413
    assert r.json()["error"] == "too_large" and "clipboard's limit of 512 KiB" in r.json()["detail"]
    assert guests["desk"].argvs == [] and guests["desk"].clipboard == b"before"
    guests["desk"].clipboard = b"y" * (clipboard.MAX_BYTES + 1)     # copied in the guest
    r = client.get("/api/capsules/desk/clipboard")
    assert r.status_code == 413 and "capsule 'desk''s clipboard is larger" in r.json()["detail"]


def test_unknown_stopped_or_malformed_is_refused(client, guests):
    csrf = sign_in(client)
    h = {"X-CSRF-Token": csrf}
    r = client.get("/api/capsules/nosuch/clipboard")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    r = client.put("/api/capsules/off/clipboard", json={"text": "x"}, headers=h)
    assert r.status_code == 409 and "not running" in r.json()["detail"]
    r = client.put("/api/capsules/desk/clipboard", json={"txt": "x"}, headers=h)
    assert r.status_code == 400 and "text" in r.json()["detail"]
    assert guests["desk"].argvs == []


def test_a_change_needs_the_sessions_csrf_token(client, guests):
    sign_in(client)
    r = client.put("/api/capsules/desk/clipboard", json={"text": "x"})
    assert r.status_code == 403
    assert guests["desk"].argvs == []


def test_an_owner_reaches_only_the_clipboard_of_its_own_capsules(client, home, guests):  # noqa: F811
    store = Store.open(home / "a")
    users.add(store, "root", "admin", "correct horse battery")
    users.add(store, "alice", "owner")
    owners.set_owner(store, "desk", "alice")
    owners.set_owner(store, "other", "root")
    alice = {"Authorization": f"Bearer {tokens.create(store, 'alice', 'read,capsules')[1]}"}
    reader = {"Authorization": f"Bearer {tokens.create(store, 'alice', 'read')[1]}"}
    store.close()
    guests["other"].clipboard = b"root's secret"
    r = client.get("/api/capsules/other/clipboard", headers=alice)
    assert r.status_code == 403 and "not yours" in r.json()["detail"]
    r = client.put("/api/capsules/other/clipboard", json={"text": "x"}, headers=alice)
    assert r.status_code == 403 and guests["other"].argvs == [] and guests["other"].clipboard == b"root's secret"
    assert client.get("/api/capsules/desk/clipboard", headers=reader).status_code == 403   # a read-only token
    assert client.put("/api/capsules/desk/clipboard", json={"text": "mine"}, headers=alice).status_code == 200
    assert client.get("/api/capsules/desk/clipboard", headers=alice).json()["text"] == "mine"


def test_the_screen_size_is_brought_within_what_the_card_shows(client, guests):
    csrf = sign_in(client)
    h = {"X-CSRF-Token": csrf}
    r = client.put("/api/capsules/desk/screen-size", json={"width": 1501, "height": 900}, headers=h)
    assert r.status_code == 200, r.text
    assert r.json() == {"width": 1488, "height": 900} and guests["desk"].screen == (1488, 900)
    r = client.put("/api/capsules/desk/screen-size", json={"width": 5000, "height": 100}, headers=h)
    assert r.json() == {"width": 2560, "height": 400} and guests["desk"].screen == (2560, 400)
    # a screen larger than two frames of the card's memory hold: the same shape, smaller (the page scales it up)
    for want, got in (((2560, 1600), (1824, 1144)), ((1920, 1200), (1824, 1144)), ((2560, 1440), (1920, 1086))):
        r = client.put("/api/capsules/desk/screen-size", json={"width": want[0], "height": want[1]}, headers=h)
        assert r.json() == {"width": got[0], "height": got[1]} and guests["desk"].screen == got
        assert got[0] * got[1] * 4 * 2 <= 16 * 1024 * 1024
    assert guests["other"].screen == (1280, 800)


def test_a_size_the_guest_answers_beyond_what_the_card_shows_is_refused(client, guests):
    csrf = sign_in(client)
    plays = guests["desk"].exec

    def boasts(argv, args):
        out = plays(argv, args)
        return out | {"stdout": "99999999 1\n"} if argv[2:3] == ["size"] else out

    guests["desk"].answer = boasts
    r = client.put("/api/capsules/desk/screen-size", json={"width": 1024, "height": 768},
                   headers={"X-CSRF-Token": csrf})
    assert r.status_code == 409 and "99999999 1" in r.json()["detail"], r.text


def test_a_screen_size_that_is_none_or_not_allowed_is_refused(client, home, guests):  # noqa: F811
    csrf = sign_in(client)
    h = {"X-CSRF-Token": csrf}
    for body in ({"width": 0, "height": 600}, {"width": 800, "height": -1}, {"width": 99999, "height": 600}):
        r = client.put("/api/capsules/desk/screen-size", json=body, headers=h)
        assert r.status_code == 400 and "1 to 16384" in r.json()["detail"], body
    r = client.put("/api/capsules/desk/screen-size", json={"width": "wide", "height": 600}, headers=h)
    assert r.status_code == 400
    assert client.put("/api/capsules/desk/screen-size", json={"width": 800, "height": 600}).status_code == 403
    r = client.put("/api/capsules/off/screen-size", json={"width": 800, "height": 600}, headers=h)
    assert r.status_code == 409
    store = Store.open(home / "a")
    users.add(store, "alice", "owner")
    owners.set_owner(store, "desk", "alice")
    bob = {"Authorization": f"Bearer {tokens.create(store, 'alice', 'read,capsules')[1]}"}
    store.close()
    r = client.put("/api/capsules/other/screen-size", json={"width": 800, "height": 600}, headers=bob)
    assert r.status_code == 403
    assert guests["desk"].argvs == [] and guests["other"].argvs == []
