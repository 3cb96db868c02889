"""Peers (capsule host add/ls/rm): names and URLs checked before any contact, the peer must answer with
its token, its store id is recorded; listing asks every peer at once within one deadline."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from capsule import hosts
from capsule.errors import AlreadyExists, AuthFailed, Conflict, InvalidName, NotFound, Unreachable
from capsule.store import Store
from tests.helpers.inprocess_agent import InProcessAgent, SilentPeer, free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN_A = "a-token-of-host-a-0123456789"
TOKEN_B = "b-token-of-host-b-0123456789"
TOKEN_C = "c-token-of-host-c-0123456789"


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "a")
    yield s
    s.close()


@pytest.fixture
def peer(tmp_path):
    agent = InProcessAgent(tmp_path / "b", TOKEN_B)
    yield agent
    agent.stop()


@pytest.mark.parametrize("name", ["", "a b", "../x", "-dash", "x" * 64, "home/office"])
def test_bad_names_are_refused_before_any_contact(store, name):
    with pytest.raises(InvalidName, match="invalid host name"):
        hosts.add(store, name, f"http://127.0.0.1:{free_port()}", TOKEN_B)
    assert hosts.peers(store) == []


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:1", "127.0.0.1:8000", "http://", "http://127.0.0.1:99999",
                                 "http://127.0.0.1:8000/api", "http://me:pw@127.0.0.1:8000",
                                 "http://127.0.0.1:8000/?x=1", "http://127.0.0.1:8000/#top", "http://a b:1",
                                 "http://127.0.0.1:8000\n"])
def test_bad_urls_are_refused_before_any_contact(store, url):
    with pytest.raises(InvalidName, match="agent URL"):
        hosts.add(store, "b", url, TOKEN_B)
    assert hosts.peers(store) == []


def test_url_is_normalised():
    assert hosts.check_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert hosts.check_url("HTTPS://Example.org") == "https://example.org"
    assert hosts.check_url("http://[::1]:9") == "http://[::1]:9"


def test_short_token_is_refused(store, peer):
    with pytest.raises(InvalidName, match="at least 16"):
        hosts.add(store, "b", peer.url, "short")


def test_unreachable_peer_is_not_added(store):
    with pytest.raises(Unreachable):
        hosts.add(store, "b", f"http://127.0.0.1:{free_port()}", TOKEN_B, timeout=2)
    assert hosts.peers(store) == []


def test_wrong_token_is_not_added(store, peer):
    with pytest.raises(AuthFailed):
        hosts.add(store, "b", peer.url, TOKEN_C)
    assert hosts.peers(store) == []


def test_add_records_the_store_id_and_refuses_duplicates(store, peer, tmp_path):
    p = hosts.add(store, "b", peer.url + "/", TOKEN_B)
    peer_id = Store.open(tmp_path / "b").id
    assert (p.name, p.url, p.store_id) == ("b", peer.url, peer_id)
    assert hosts.peers(store) == [p]
    assert "token" not in p.as_dict() and TOKEN_B not in repr(p)
    with pytest.raises(AlreadyExists, match="already known"):
        hosts.add(store, "b", peer.url, TOKEN_B)
    with pytest.raises(AlreadyExists, match="already known as host 'b'"):
        hosts.add(store, "b2", peer.url, TOKEN_B)
    # the same store under another URL (localhost for 127.0.0.1)
    with pytest.raises(AlreadyExists, match=f"store {peer_id}, already known"):
        hosts.add(store, "b3", f"http://localhost:{peer.port}", TOKEN_B)
    # the table survives reopening the store
    again = Store.open(store.home)
    assert [x.name for x in hosts.peers(again)] == ["b"]
    again.close()


def test_own_agent_is_refused(store):
    own = InProcessAgent(store.home, TOKEN_A)
    try:
        with pytest.raises(Conflict, match="this host's own agent"):
            hosts.add(store, "me", own.url, TOKEN_A)
    finally:
        own.stop()


def test_rm(store, peer):
    hosts.add(store, "b", peer.url, TOKEN_B)
    with pytest.raises(NotFound, match="no host named 'c'"):
        hosts.remove(store, "c")
    assert hosts.remove(store, "b").name == "b"
    assert hosts.peers(store) == []


def test_ask_all_marks_a_peer_that_went_down_and_keeps_the_others(store, peer, tmp_path):
    other = InProcessAgent(tmp_path / "c", TOKEN_C)
    try:
        hosts.add(store, "b", peer.url, TOKEN_B)
        hosts.add(store, "c", other.url, TOKEN_C)
        assert [(s.peer.name, s.reachable) for s in hosts.ask_all(store)] == [("b", True), ("c", True)]
        other.stop()
        by_name = {s.peer.name: s for s in hosts.ask_all(store)}
        assert by_name["b"].reachable and by_name["b"].error is None
        assert not by_name["c"].reachable and "cannot reach" in by_name["c"].error
    finally:
        other.stop()


def test_ask_all_keeps_its_deadline_with_a_hung_peer(store, peer):
    hosts.add(store, "b", peer.url, TOKEN_B)
    silent = SilentPeer()
    try:
        # recorded directly: a hung host could never be added, but one can hang later
        store.catalogue.query("INSERT INTO peers VALUES(?,?,?,?,?,NULL)",
                              ("hung", silent.url, TOKEN_C, "00000000", 0.0))
        t0 = time.monotonic()
        by_name = {s.peer.name: s for s in hosts.ask_all(store, timeout=1.0)}
        assert time.monotonic() - t0 < 3.0
        assert by_name["b"].reachable
        assert not by_name["hung"].reachable and "no answer within 1s" in by_name["hung"].error
    finally:
        silent.close()


def test_ask_all_flags_a_peer_now_serving_another_store(store, peer, tmp_path):
    hosts.add(store, "b", peer.url, TOKEN_B)
    store.catalogue.query("UPDATE peers SET store_id='ffffffff' WHERE name='b'")
    (st,) = hosts.ask_all(store)
    assert not st.reachable and "answers as another store" in st.error


def test_cli_add_ls_rm(store, peer, tmp_path):
    from capsule.cli.main import app

    token_file = tmp_path / "b.token"
    token_file.write_text(TOKEN_B + "\n")
    runner = CliRunner()
    home = ["--home", str(store.home)]
    r = runner.invoke(app, [*home, "host", "add", "b", peer.url, "--token-file", str(token_file), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["name"] == "b"
    r = runner.invoke(app, [*home, "host", "ls", "--json"])
    (row,) = json.loads(r.stdout)
    assert (row["name"], row["reachable"], row["error"]) == ("b", True, None)
    assert TOKEN_B not in r.stdout
    peer.stop()
    (row,) = json.loads(runner.invoke(app, [*home, "host", "ls", "--json"]).stdout)
    assert row["reachable"] is False and row["error"]
    r = runner.invoke(app, [*home, "host", "add", "x", "http://127.0.0.1:1/path", "--token-file", str(token_file)])
    assert isinstance(r.exception, InvalidName)
    r = runner.invoke(app, [*home, "host", "rm", "b", "--json"])
    assert json.loads(r.stdout) == {"removed": "b"}
    assert json.loads(runner.invoke(app, [*home, "host", "ls", "--json"]).stdout) == []
