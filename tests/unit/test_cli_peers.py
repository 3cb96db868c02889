"""A peer is named the same way by every command: a known host's name (its URL, token and pin from `capsule host
add`) or an agent URL (token from --token-file or CAPSULE_TOKEN, else the known host's at that URL), read by one
resolver. Commands that took only URLs or only names take both; bad input is refused and changes nothing."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from capsule import hosts
from capsule.backup import jobs
from capsule.cli.common import PeerCall, known_host_name, resolve_peer
from capsule.errors import AuthFailed, InvalidInput, InvalidName, NotFound
from capsule.fleet import members
from capsule.store import Store
from capsule.store.catalogue import CapsuleRow, VersionRow
from capsule.transfer.records import record_version
from tests.helpers.inprocess_agent import InProcessAgent
from tests.helpers.received import receive_file, receive_layer, record_of
from tests.unit.clirun import invoke, json_out

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN = "the-token-of-host-home-0123456"
URL = "https://home.example:7070"
PIN = "SHA256:" + "A" * 43


def _know(store: Store, name: str = "home", url: str = URL, token: str = TOKEN, pin: str | None = PIN) -> None:
    store.catalogue.query("INSERT INTO peers(name, url, token, store_id, added, fingerprint) VALUES(?,?,?,?,?,?)",
                          (name, url, token, "abcdef0123", time.time(), pin))


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.delenv("CAPSULE_TOKEN", raising=False)
    s = Store.open(tmp_path / "s")
    _know(s)
    s.catalogue.add_capsule(CapsuleRow("desk", "u-1", "tiny", None, None, time.time()))
    s.catalogue.add_version(VersionRow("desk", 1, None, None, None, [], {"kernel": "k", "initrd": "i"}, "created",
                                       time.time()))
    yield s
    s.close()


def test_one_resolver_reads_a_name_or_a_url(store, tmp_path, monkeypatch):
    other = tmp_path / "other.token"
    other.write_text("o" * 24 + "\n")
    assert resolve_peer(store, "home") == PeerCall(URL, TOKEN, "home", PIN)
    # the known host's URL (however it is spelt) is that host: its token and pin, unless given
    assert resolve_peer(store, URL + "/") == PeerCall(URL, TOKEN, "home", PIN)
    assert resolve_peer(store, "home", other, "SHA256:" + "B" * 43) == PeerCall(URL, "o" * 24, "home",
                                                                                 "SHA256:" + "B" * 43)
    monkeypatch.setenv("CAPSULE_TOKEN", "e" * 24)
    assert resolve_peer(store, URL).token == "e" * 24
    monkeypatch.delenv("CAPSULE_TOKEN")
    # an unknown URL needs a token, and has no pin of its own
    assert resolve_peer(store, "http://other:7070", other) == PeerCall("http://other:7070", "o" * 24,
                                                                       "http://other:7070", None)
    with pytest.raises(AuthFailed, match="--token-file"):
        resolve_peer(store, "http://other:7070")
    with pytest.raises(NotFound, match="no host named 'office'"):
        resolve_peer(store, "office")
    with pytest.raises(InvalidName, match="invalid agent URL"):
        resolve_peer(store, "https://home:7070/some/path", other)
    # where the host must be known already, a URL is the known host there
    assert known_host_name(store, "home") == "home" and known_host_name(store, URL) == "home"
    with pytest.raises(NotFound, match="`capsule host add NAME http://other:7070"):
        known_host_name(store, "http://other:7070")


@pytest.fixture
def source(tmp_path):
    """An agent serving a store that holds cap@1."""
    home, work = tmp_path / "src", tmp_path / "work"
    work.mkdir()
    s = Store.open(home)
    record_version(s, record_of("cap", 1, [receive_layer(s, work, 3)], receive_file(s, work, 4, "kernel"),
                                receive_file(s, work, 5, "initrd")))
    s.close()
    agent = InProcessAgent(home, TOKEN)
    yield agent
    agent.stop()


def test_pull_and_push_take_a_known_hosts_name_or_its_url(tmp_path, source, monkeypatch):
    monkeypatch.delenv("CAPSULE_TOKEN", raising=False)
    here = tmp_path / "here"
    s = Store.open(here)
    _know(s, "work", source.url, TOKEN, None)
    s.close()
    pulled = json_out(invoke(here, "pull", "cap", "--from", "work", "--json"))   # was: only a URL
    assert pulled["version"] == "cap@1" and pulled["recorded"] and pulled["url"] == source.url
    # its URL without --token-file or CAPSULE_TOKEN: the known host's token (was: "no token")
    pushed = json_out(invoke(here, "push", "cap@1", "--to", source.url + "/", "--json"))
    assert pushed["version"] == "cap@1" and len(pushed["skipped"]) == 3


def test_backup_copies_go_to_a_known_host_named_or_by_url(store):
    r = invoke(store.home, "backup", "schedule", "desk", "--every", "daily", "--to", URL, "--json")
    assert json_out(r)["target"] == "home"
    job = jobs.get(store, "desk").as_dict()
    assert job["target"] == "home"
    r = invoke(store.home, "backup", "schedule", "desk", "--every", "weekly", "--to", "http://vault:7070")
    assert isinstance(r.exception, NotFound) and "capsule host add NAME http://vault:7070" in str(r.exception)
    assert jobs.get(store, "desk").as_dict() == job


def test_hosts_and_fleet_members_by_name_or_url(store):
    r = invoke(store.home, "fleet", "add", URL, "--group", "edge", "--json")        # a known host, no URL again
    assert json_out(r)["host"] == "home" and [m.name for m in members.members(store, "edge")] == ["home"]
    r = invoke(store.home, "fleet", "add", "home", "--token-file", "x")
    assert isinstance(r.exception, InvalidInput) and "give its URL too" in str(r.exception)
    r = invoke(store.home, "fleet", "add", "office")
    assert isinstance(r.exception, NotFound) and "capsule fleet add NAME https://HOST:PORT" in str(r.exception)
    assert json_out(invoke(store.home, "fleet", "rm", URL, "--json")) == {"removed": "home"}
    assert members.members(store) == []
    assert json_out(invoke(store.home, "host", "rm", URL, "--json")) == {"removed": "home"}
    assert hosts.peers(store) == []


def test_fleet_rollouts_name_their_hosts_by_name_or_url(store, monkeypatch):
    from capsule.fleet import push as pushing
    from capsule.fleet.plan import Plan
    from capsule.fleet.rollout import Outcome

    asked = []

    def push(st, ref, opts, on_event, transfer_opts=None):
        asked.append((ref, opts.hosts, transfer_opts.level))
        return pushing.PushReport(ref, Plan(()), Outcome([], 0, None), 0.0)

    monkeypatch.setattr(pushing, "push", push)
    r = invoke(store.home, "fleet", "push", "desk@1", "--to", URL, "--to", "edge2", "--zstd-level", "12", "--json")
    assert json_out(r)["version"] == "desk@1" and asked == [("desk@1", ["home", "edge2"], 12)]
    r = invoke(store.home, "fleet", "rollback", "desk")
    assert isinstance(r.exception, InvalidInput) and "NAME@V, e.g. desk@3" in str(r.exception)
    assert len(asked) == 1


def test_start_from_and_pod_migrate_on_take_a_known_hosts_name(store, monkeypatch):
    from capsule import transfer
    from capsule.cli import transfer as cli
    from capsule.pod import remote

    calls = []

    def run(st, url, ref, token, **kw):
        calls.append(("run", url, ref, token, kw["fingerprint"]))
        return transfer.RunReport(transfer.TransferReport("pull", ref, url), SimpleNamespace(
            mode="boot", domain="d", seconds=1.0, version=SimpleNamespace(ref=ref)), [])

    def migrate(st, ref, to, url, token, *, fingerprint=None, progress=None):
        calls.append(("pod", url, ref, to, token, fingerprint))
        return {"pod": ref, "from": "a", "to": to, "ip": "198.18.0.2/24", "checkpoint_seconds": 0.1,
                "restore_seconds": 0.1, "wire_bytes": 1}

    monkeypatch.setattr(cli.transfer, "run", run)
    monkeypatch.setattr(remote, "migrate", migrate)
    assert json_out(invoke(store.home, "start", "desk@1", "--from", "home", "--json"))["mode"] == "boot"
    assert json.loads(invoke(store.home, "pod", "migrate", "a/web", "--to", "b", "--on", "home",
                             "--json").stdout)["host"] == "home"
    assert calls == [("run", URL, "desk@1", TOKEN, PIN), ("pod", URL, "a/web", "b", TOKEN, PIN)]


@pytest.mark.parametrize(("args", "needle"), [
    (["start", "desk", "--prefetch"], "give --from PEER too"),
    (["start", "desk", "--fingerprint", PIN], "give --from PEER too"),
    (["pod", "migrate", "a/web", "--to", "b", "--token-file", "t"], "give --on PEER too"),
    (["pull", "cap"], "--from PEER"),
    (["pull", "http://x:1", "cap", "--from", "home"], "capsule pull NAME[@V] --from PEER"),
    (["push", "desk", "--to", "ftp://home"], "invalid agent URL"),
])
def test_an_incomplete_or_malformed_peer_is_refused_before_anything_runs(store, args, needle):
    r = invoke(store.home, *args)
    assert r.exit_code != 0 and needle in str(r.exception), (r.exception, r.stdout)
    assert r.exception.exit_code == 2
    assert store.catalogue.instance("desk") is None
