"""Which move a request asks for: a mode or ballooning named means an offline move, never a live one in silence;
live asked for with a mode is refused naming the conflict; post-copy only on a live move. The rule itself, the
command line (`capsule migrate`) and the dashboard's API over HTTP."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from capsule import hosts
from capsule import migrate as lib
from capsule.errors import Conflict, InvalidName
from capsule.migrate.choice import Choice, choose
from capsule.store import Store
from tests.unit.test_dashboard_api import PEER_TOKEN, SECRET, home  # noqa: F401 - fixture
from tests.unit.test_migrations_api import world  # noqa: F401 - fixture
from tests.wait import wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize(("live", "mode", "balloon", "expected"), [
    (None, None, False, Choice(True, "live")),
    (True, None, False, Choice(True, "live")),
    (None, "full", False, Choice(False, "full")),
    (None, "demand", False, Choice(False, "demand")),
    (None, None, True, Choice(False, "full")),
    (False, None, False, Choice(False, "full")),
    (False, "demand", True, Choice(False, "demand")),
])
def test_a_mode_or_balloon_makes_the_move_offline(live, mode, balloon, expected):
    assert choose(live, mode, balloon) == expected


@pytest.mark.parametrize(("mode", "balloon", "named"), [("full", False, "mode"), (None, True, "balloon"),
                                                        ("demand", True, "mode and balloon")])
def test_live_with_a_mode_is_refused_naming_the_conflict(mode, balloon, named):
    with pytest.raises(InvalidName, match=f"live: true conflicts with {named}"):
        choose(True, mode, balloon)


def test_post_copy_on_an_offline_move_is_refused():
    with pytest.raises(InvalidName, match="postcopy is for live moves"):
        choose(None, "full", False, postcopy=True)
    assert choose(None, None, False, postcopy=True) == Choice(True, "live")


# What the stand-in below raises once it has kept the call it was given. An existing class: a test
# that defined its own error class would register a wire code for the whole process.
RECORDED = "recorded by the stand-in"


@pytest.fixture
def cli(home, tmp_path, monkeypatch):  # noqa: F811
    """The command line on this store, with a peer "office" and capsule.migrate.migrate recording its call."""
    from tests.helpers.inprocess_agent import InProcessAgent

    peer = InProcessAgent(tmp_path / "b", PEER_TOKEN)
    store = Store.open(home)
    try:
        hosts.add(store, "office", peer.url, PEER_TOKEN)
    finally:
        store.close()
    calls: list[dict] = []

    def stand_in(store, name, to, token, **kw):
        calls.append(kw)
        raise Conflict(RECORDED)

    monkeypatch.setattr(lib, "migrate", stand_in)
    monkeypatch.setenv("CAPSULE_HOME", str(home))
    yield calls
    peer.stop()


@pytest.mark.parametrize(("args", "live", "mode"), [
    ([], True, None),
    (["--mode", "full"], False, "full"),
    (["--mode", "demand", "--source-url", "http://127.0.0.1:9"], False, "demand"),
    (["--balloon"], False, "full"),
    (["--offline"], False, "full"),
])
def test_the_command_line_moves_offline_when_a_mode_or_balloon_is_named(cli, args, live, mode):
    from capsule.cli.main import app

    r = CliRunner().invoke(app, ["migrate", SECRET, "--to", "office", *args])
    assert isinstance(r.exception, Conflict) and str(r.exception) == RECORDED, r.output
    assert cli[-1]["live"] is live
    if mode is not None:
        assert cli[-1]["mode"] == mode


def test_the_command_line_refuses_post_copy_on_an_offline_move(cli):
    from capsule.cli.main import app

    r = CliRunner().invoke(app, ["--json", "migrate", SECRET, "--to", "office", "--mode", "full", "--postcopy"])
    assert cli == [] and isinstance(r.exception, InvalidName)
    assert "--postcopy is for live moves, and --mode makes this one offline" in str(r.exception)


def test_the_api_moves_offline_when_a_mode_or_balloon_is_named(world):  # noqa: F811
    client, csrf, stand_in, _peer = world
    h = {"X-CSRF-Token": csrf}
    for body, live, mode in (({"mode": "full"}, False, "full"), ({"balloon": True}, False, "full"),
                             ({"live": False}, False, "full"), ({}, True, "live")):
        _one(client, h, stand_in, body, live, mode)


def _one(client, h, stand_in, body: dict, live: bool, mode: str) -> None:
    n = len(stand_in.calls)
    r = client.post(f"/api/capsules/{SECRET}/migrate", json={"to": "office"} | body, headers=h)
    assert r.status_code == 202, r.text
    assert r.json()["mode"] == mode
    wait_until(lambda: len(stand_in.calls) > n, 10, "the migration to start")
    assert stand_in.calls[-1]["live"] is live
    stand_in.go.set()
    mid = r.json()["id"]
    wait_until(lambda: client.get(f"/api/migrations/{mid}").json()["progress"]["outcome"], 10, "its end")
    stand_in.go.clear()


def test_the_api_refuses_live_with_a_mode_naming_the_conflict(world):  # noqa: F811
    client, csrf, stand_in, _peer = world
    for body in ({"live": True, "mode": "demand"}, {"live": True, "balloon": True}):
        r = client.post(f"/api/capsules/{SECRET}/migrate", json={"to": "office"} | body,
                        headers={"X-CSRF-Token": csrf})
        assert r.status_code == 400, r.text
        assert "live: true conflicts with" in r.json()["detail"]
    assert stand_in.calls == [] and client.get("/api/migrations").json() == []
