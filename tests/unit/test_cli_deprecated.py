"""Every old spelling of the CLI still works for one release: it does what the new spelling does (the same
library call, the same --json on stdout) and says on stderr which spelling replaces it. Pushes and pulls go
to real in-process agents; the verbs that would boot a guest or reach into one (start --from, pods) meet a
stand-in for the library call they make, which records it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from capsule.store import Store
from capsule.transfer.records import record_version
from tests.helpers.inprocess_agent import InProcessAgent
from tests.helpers.received import receive_file, receive_layer, record_of
from tests.unit.clirun import invoke, json_out, warned

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN = "a-token-of-the-other-agent-0123"
ENV = {"CAPSULE_TOKEN": TOKEN}
PER_CALL = frozenset({"seconds", "commit_seconds", "url", "wire_bytes",   # differ between two agents
                      "codec", "codecs", "link_rate"})               # picked by the link each measures


@pytest.fixture
def source(tmp_path):
    """A store holding cap@1: one layer, a kernel, an initrd."""
    home, work = tmp_path / "src", tmp_path / "work"
    work.mkdir()
    s = Store.open(home)
    layer = receive_layer(s, work, 3)
    record_version(s, record_of("cap", 1, [layer], receive_file(s, work, 4, "kernel"),
                                receive_file(s, work, 5, "initrd")))
    s.close()
    return home


@pytest.fixture
def agents(tmp_path):
    started: list[InProcessAgent] = []

    def start(home):
        started.append(InProcessAgent(home, TOKEN))
        return started[-1]

    yield start
    for a in started:
        a.stop()


def _one_warning(result, old: str, new: str) -> None:
    (line,) = warned(result)
    assert old in line and f"use {new}" in line and "removed after 0.2" in line, line


def test_level_is_zstd_level(source, agents, tmp_path, monkeypatch):
    from capsule.cli import transfer as cli

    levels = []
    real = cli.transfer.push
    monkeypatch.setattr(cli.transfer, "push", lambda *a, **k: (levels.append(a[4].level), real(*a, **k))[1])
    one, two = agents(tmp_path / "r1"), agents(tmp_path / "r2")
    old = invoke(source, "push", "cap", "--to", one.url, "--level", "19", "--json", env=ENV)
    new = invoke(source, "push", "cap", "--to", two.url, "--zstd-level", "19", "--json", env=ENV)
    assert json_out(old, PER_CALL) == json_out(new, PER_CALL) and json_out(new)["recorded"]
    assert levels == [19, 19]
    _one_warning(old, "--level", "--zstd-level")
    assert warned(new) == []


def test_pull_peer_name_is_pull_name_from_peer(source, agents, tmp_path):
    src = agents(source)
    old = invoke(tmp_path / "p1", "pull", src.url, "cap@1", "--json", env=ENV)
    new = invoke(tmp_path / "p2", "pull", "cap@1", "--from", src.url, "--json", env=ENV)
    assert json_out(old, PER_CALL) == json_out(new, PER_CALL)
    assert json_out(new)["version"] == "cap@1" and json_out(new)["recorded"]
    _one_warning(old, "`capsule pull PEER NAME`", "`capsule pull NAME --from PEER`")
    assert warned(new) == []


def test_run_is_start_from(tmp_path, monkeypatch):
    from capsule import transfer

    calls = []

    def run(store, url, ref, token, **kw):
        calls.append((url, ref, token, kw["prefetch"], kw["wait"], kw["timeout"], kw["fingerprint"]))
        version = SimpleNamespace(ref=ref)
        return transfer.RunReport(transfer.TransferReport("pull", ref, url), SimpleNamespace(
            mode="boot", domain="capsule-x", seconds=1.5, version=version), ["ab" * 32])

    from capsule.cli import transfer as cli
    monkeypatch.setattr(cli.transfer, "run", run)
    token = tmp_path / "tok"
    token.write_text(TOKEN)
    peer = ["--from", "http://127.0.0.1:7070", "--token-file", str(token), "--prefetch", "--timeout", "9"]
    old = invoke(tmp_path / "b", "run", "cap@1", *peer, "--json")
    new = invoke(tmp_path / "b", "start", "cap@1", *peer, "--json")
    assert json_out(old) == json_out(new) and json_out(new)["remote_layers"] == ["ab" * 32]
    assert calls == [("http://127.0.0.1:7070", "cap@1", TOKEN, True, True, 9.0, None)] * 2
    _one_warning(old, "`capsule run NAME --from PEER`", "`capsule start NAME --from PEER`")
    assert warned(new) == []


@pytest.fixture
def pod_calls(monkeypatch):
    """The pod library calls the CLI makes, recorded; each answers what it was asked."""
    from capsule.pod import group, ops, remote

    calls = []

    def stand_in(name):
        def call(store, *args, **kw):
            calls.append((name, *args, *(f"{k}={v}" for k, v in sorted(kw.items()) if k != "progress")))
            return {"called": name, "args": list(args), "name": "web", "ip": "198.18.0.9/24", "seconds": 0.5,
                    "pod": "a/web", "from": "a", "to": args[1] if len(args) > 1 else None, "wire_bytes": 7,
                    "checkpoint_seconds": 0.1, "restore_seconds": 0.2, "members": []}
        return call

    for module, name in ((ops, "suspend"), (ops, "resume"), (ops, "restore"), (remote, "migrate"),
                         (group, "restore_group")):
        monkeypatch.setattr(module, name, stand_in(f"{module.__name__.rsplit('.', 1)[1]}.{name}"))
    return calls


@pytest.mark.parametrize(("old", "new", "call", "says", "instead"), [
    (["pod", "suspend", "a/web"], ["pod", "freeze", "a/web"], ("ops.suspend", "a/web"),
     "`capsule pod suspend`", "`capsule pod freeze`"),
    (["pod", "resume", "a/web"], ["pod", "thaw", "a/web"], ("ops.resume", "a/web"),
     "`capsule pod resume`", "`capsule pod thaw`"),
    (["pod", "restore", "abcdef12", "--into", "b"], ["pod", "restore", "abcdef12", "--to", "b"],
     ("ops.restore", "abcdef12", "b"), "--into", "--to"),
    (["pod", "restore-group", "abcdef12", "--into", "web=b"], ["pod", "restore-group", "abcdef12", "--to", "web=b"],
     ("group.restore_group", "abcdef12", {"web": "b"}), "--into", "--to POD=CAPSULE"),
    (["pod", "migrate", "a/web", "--to", "b", "--host", "http://127.0.0.1:7070"],
     ["pod", "migrate", "a/web", "--to", "b", "--on", "http://127.0.0.1:7070"],
     ("remote.migrate", "a/web", "b", "http://127.0.0.1:7070", TOKEN, "fingerprint=None"), "--host", "--on"),
])
def test_old_pod_spellings(tmp_path, pod_calls, old, new, call, says, instead):
    before = invoke(tmp_path / "s", *old, "--json", env=ENV)
    after = invoke(tmp_path / "s", *new, "--json", env=ENV)
    assert json_out(before) == json_out(after)
    assert pod_calls == [call, call]
    _one_warning(before, says, instead)
    assert warned(after) == []


@pytest.fixture
def fleet_calls(monkeypatch):
    """fleet push and rollback as the CLI calls them, recorded; the report names the hosts asked for."""
    from capsule.fleet import push as pushing
    from capsule.fleet.plan import Plan, Stage
    from capsule.fleet.rollout import Outcome

    calls = []

    def report(ref, opts):
        return pushing.PushReport(ref, Plan((Stage("all", tuple(opts.hosts or ())),)), Outcome([], 0, None), 0.0)

    def push(store, ref, opts, on_event, transfer_opts=None):
        calls.append(("push", ref, opts.hosts, opts.activate))
        return report(ref, opts)

    def rollback(store, name, to, opts, on_event):
        calls.append(("rollback", name, to, opts.hosts))
        return report(f"{name}{to}", opts)

    monkeypatch.setattr(pushing, "push", push)
    monkeypatch.setattr(pushing, "rollback", rollback)
    return calls


@pytest.mark.parametrize(("old", "new", "call", "says", "instead"), [
    (["push", "web@4", "--host", "h1", "--host", "h2"], ["push", "web@4", "--to", "h1", "--to", "h2"],
     ("push", "web@4", ["h1", "h2"], False), "--host", "--to PEER"),
    (["rollback", "web", "--to", "@3"], ["rollback", "web@3"], ("rollback", "web", "@3", None),
     "`capsule fleet rollback NAME --to @V`", "`capsule fleet rollback NAME@V`"),
    (["rollback", "web@3", "--host", "h1"], ["rollback", "web@3", "--to", "h1"], ("rollback", "web", "@3", ["h1"]),
     "--host", "--to PEER"),
])
def test_old_fleet_spellings(tmp_path, fleet_calls, old, new, call, says, instead):
    before = invoke(tmp_path / "s", "fleet", *old, "--json")
    after = invoke(tmp_path / "s", "fleet", *new, "--json")
    assert json_out(before) == json_out(after)
    assert fleet_calls == [call, call]
    _one_warning(before, says, instead)
    assert warned(after) == []


def _with_desk(home):
    from capsule.store.catalogue import CapsuleRow, VersionRow

    s = Store.open(home)
    s.catalogue.add_capsule(CapsuleRow("desk", "u-1", "tiny", None, None, 1.0))
    s.catalogue.add_version(VersionRow("desk", 1, None, None, None, [], {"kernel": "k", "initrd": "i"}, "created", 1.0))
    s.close()
    return home


def test_backup_schedule_memory_is_with_memory(tmp_path):
    from capsule.errors import Conflict

    when = frozenset({"created", "next_run"})
    old = invoke(_with_desk(tmp_path / "a"), "backup", "schedule", "desk", "--every", "daily", "--memory", "--json")
    new = invoke(_with_desk(tmp_path / "b"), "backup", "schedule", "desk", "--every", "daily", "--with-memory",
                 "--json")
    assert json_out(old, when) == json_out(new, when) and json_out(new)["mode"] == "memory"
    _one_warning(old, "--memory", "--with-memory")
    assert warned(new) == []
    both = invoke(tmp_path / "a", "backup", "schedule", "desk", "--every", "weekly", "--memory", "--disk-only")
    assert isinstance(both.exception, Conflict)


def test_backup_verify_schedule_is_every(tmp_path):
    old = invoke(tmp_path / "a", "backup", "verify", "--schedule", "Sun 04:00", "--json")
    new = invoke(tmp_path / "b", "backup", "verify", "--every", "Sun 04:00", "--json")
    assert json_out(old) == json_out(new) and json_out(new)["calendar"] == "Sun 04:00"
    _one_warning(old, "--schedule", "--every")
    assert warned(new) == []
