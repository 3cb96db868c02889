"""A migration's phases, its progress that only moves forward, and cancelling it: the orchestration in
capsule.migrate with fake steps (no guest, no host), and the tracker on its own."""

from __future__ import annotations

import contextlib
import threading

import pytest

from capsule import lifecycle
from capsule.errors import Cancelled, InvalidInput, InvalidName
from capsule.exchange.running import request_pin
from capsule.migrate import MigrationCancelled, MigrationFailed, Reached, Steps, migrate
from capsule.migrate.progress import PHASES, CancelToken, Snapshot, Tracker, planned
from capsule.store.catalogue import VersionRow
from hashcache.transport import tls

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

MiB = 1024 * 1024
MEMORY, LAYER, BOOT = 8 * MiB, 12 * MiB, 2 * MiB


class FakeHosts(Steps):
    """A source and a destination as far as migrate can tell: suspend makes vm@2, push reports its objects
    batch by batch (1 MiB each, a quarter of them found at the destination, the kernel already there),
    start there answers like an agent. Records what happened."""

    def __init__(self, *, fail_push: Exception | None = None, wire_goes_back: bool = False) -> None:
        self.calls: list[str] = []
        self.batches = 0
        self.fail_push = fail_push
        self.wire_goes_back = wire_goes_back
        self.running_here = True
        self.running_there = False

    def claim(self, store, name):  # noqa: ANN001, ANN201 - no store here to claim the capsule in
        return contextlib.nullcontext()

    def suspend(self, store, name, *, balloon, balloon_method, say, phase):  # noqa: ARG002
        if balloon is not None:
            phase("balloon")
            self.calls.append("balloon")
        phase("save")
        self.calls.append("save")
        self.running_here = False
        v = VersionRow(name, 2, name, 1, "m" * 64, [["l" * 64]], {"kernel": "k" * 64, "initrd": "i" * 64}, "", 0.0)
        return lifecycle.SealResult(v)

    def push(self, store, ref, to, token, *, progress, check, files_only=False, fingerprint=None):  # noqa: ARG002
        self.calls.append("push files" if files_only else "push")
        wire = 0
        objects = [("file", "m", "memory", MEMORY, False), ("file", "k", "kernel", BOOT // 2, True),
                   ("file", "i", "initrd", BOOT // 2, False)]
        if not files_only:
            objects.insert(1, ("layer", "l", "layer", LAYER, False))
        for kind, oid, role, raw, present in objects:
            check()
            progress.object(kind, oid, role, raw, present)
            if present:
                continue
            for i in range(raw // MiB):
                check()
                self.batches += 1
                if self.fail_push is not None and self.batches == 5:
                    raise self.fail_push
                progress.advance(MiB)
                if i % 4 == 0:
                    progress.local(MiB)
                else:
                    wire += MiB // 2
                progress.wire(wire - MiB if self.wire_goes_back and i % 3 == 2 else wire)
        return None

    def restore(self, store, ref, *, wait):  # noqa: ARG002
        self.calls.append(f"restore {ref}")
        self.running_here = True

    def start_there(self, to, token, name, number, fingerprint=None):  # noqa: ARG002
        self.pins = [*getattr(self, "pins", []), fingerprint]
        self.calls.append(f"start {name}@{number}")
        self.running_there = True
        return {"mode": "restore"}

    def run_there(self, to, token, body, fingerprint=None):  # noqa: ARG002
        self.pins, self.run_body = [*getattr(self, "pins", []), fingerprint], body
        self.calls.append(f"run {body['ref']}")
        self.running_there = True
        return {"mode": "restore", "remote_layers": ["l" * 64]}

    def sizes(self, store, version, mode):  # noqa: ARG002
        return {"memory": MEMORY + BOOT} if mode == "demand" else {"memory": MEMORY, "disk": LAYER + BOOT}

    def reached(self, store, version, to, token, fingerprint=None):  # noqa: ARG002
        return Reached(present=[], missing=["m"])


def _migrate(hosts: FakeHosts, events: list[Snapshot], **kw):
    return migrate(object(), "vm", "http://b:7070", "t" * 20, steps=hosts, on_event=events.append,  # type: ignore[arg-type]
                   to_name="b", source_url=kw.pop("source_url", "http://a:7070"), source_token="s" * 20, **kw)


def _assert_forward(events: list[Snapshot]) -> None:
    for before, after in zip(events, events[1:], strict=False):
        assert after.seq == before.seq + 1
        assert after.index >= before.index
        assert after.wire_bytes >= before.wire_bytes
        assert after.local_bytes >= before.local_bytes
        assert after.done_bytes >= before.done_bytes
        assert before.outcome is None  # nothing after the end
    for e in events:
        if e.total_bytes is not None:
            assert e.local_bytes <= e.done_bytes <= e.total_bytes


def _phases_seen(events: list[Snapshot]) -> list[str]:
    return list(dict.fromkeys(e.phase for e in events if e.phase))


@pytest.mark.parametrize("balloon", [None, "cache"])
def test_full_migration_goes_through_its_phases_in_order(balloon):
    hosts, events = FakeHosts(), []
    r = _migrate(hosts, events, mode="full", balloon=balloon)
    want = [p for p in PHASES if balloon or p != "balloon"]
    assert _phases_seen(events) == want and events[0].phases == tuple(want)
    _assert_forward(events)
    last = events[-1]
    assert r.last == last and last.outcome == "done" and last.where == "destination" and last.version == "vm@2"
    assert last.done_bytes == last.total_bytes == MEMORY + LAYER + BOOT
    # found locally: the first of every four MiB of each object, and the kernel the destination already had
    assert last.local_bytes == sum(-(-n // 4) for n in (8, 12, 1)) * MiB + BOOT // 2
    assert last.wire_bytes > 0 and not last.cancellable
    assert hosts.calls[-1] == "start vm@2" and hosts.running_there and not hosts.running_here
    # the memory image's bytes were counted in the memory phase, the layer's in the disk phase
    memory_events = [e for e in events if e.phase == "memory"]
    assert max(e.done_bytes for e in memory_events) <= MEMORY


def test_demand_migration_has_no_disk_phase_and_pushes_only_the_files():
    hosts, events = FakeHosts(), []
    r = _migrate(hosts, events, mode="demand")
    assert _phases_seen(events) == ["save", "memory", "resume"]
    _assert_forward(events)
    assert hosts.calls == ["save", "push files", "run vm@2"]
    assert r.push is None and events[-1].done_bytes == MEMORY + BOOT


def test_a_demand_migration_over_tls_sends_the_sources_pin_and_pins_the_destination():
    """The destination is called pinned to its fingerprint; the run request carries this host's, which the
    destination pins when it pages the disks in from here."""
    hosts, events = FakeHosts(), []
    mine, theirs = "SHA256:" + "M" * 43, "ab" * 32
    _migrate(hosts, events, mode="demand", source_url="https://a:7070", source_fingerprint=mine, fingerprint=theirs)
    assert hosts.run_body["fingerprint"] == mine and hosts.run_body["source"] == "https://a:7070"
    assert hosts.pins == [tls.parse_fingerprint(theirs)]
    with pytest.raises(InvalidInput, match="invalid fingerprint"):
        _migrate(FakeHosts(), [], mode="full", fingerprint="SHA256:nope")


def test_run_and_pull_requests_parse_the_sources_pin():
    assert request_pin({"source": "https://a:1"}) is None
    assert request_pin({"fingerprint": "ab" * 32}) == tls.parse_fingerprint("ab" * 32)
    with pytest.raises(InvalidName, match="must be a string"):
        request_pin({"fingerprint": 7})
    with pytest.raises(InvalidInput, match="invalid fingerprint"):
        request_pin({"fingerprint": "SHA256:x"})


def test_progress_moves_forward_even_when_the_transfer_reports_backwards():
    hosts, events = FakeHosts(wire_goes_back=True), []
    _migrate(hosts, events, mode="full")
    _assert_forward(events)


def test_an_eta_is_guessed_from_the_rate_so_far():
    now = [0.0]
    got: list[Snapshot] = []
    t = Tracker("vm", "b", planned("full", False), got.append, clock=lambda: now[0], min_interval=0)
    t.enter("save")
    t.totals({"memory": 100, "disk": 300})
    t.object("file", "m", "memory", 100, False)
    now[0] = 1.0
    t.advance(100)
    assert got[-1].eta_seconds == pytest.approx(3.0)  # 100 bytes a second, 300 to go
    t.enter("save")  # a phase already passed is ignored
    assert got[-1].phase == "memory"
    t.finish("done", "destination", "ok")
    t.finish("failed", "source", "late")  # the end is final
    assert got[-1].outcome == "done" and got[-1].eta_seconds is None


def test_cancel_between_batches_stops_the_push_and_the_guest_runs_at_the_source_again():
    token, hosts, events = CancelToken(), FakeHosts(), []

    def listener(s: Snapshot) -> None:
        events.append(s)
        if s.phase == "disk":
            token.cancel()

    with pytest.raises(MigrationCancelled) as info:
        migrate(object(), "vm", "http://b:7070", "t" * 20, steps=hosts, on_event=listener,  # type: ignore[arg-type]
                cancel=token, mode="full")
    err = info.value
    assert err.restored and err.version == "vm@2" and err.step == "push" and "cancelled" in str(err)
    assert isinstance(err, MigrationFailed) and err.exit_code == Cancelled.exit_code
    assert hosts.calls == ["save", "push", "restore vm@2"] and hosts.running_here and not hosts.running_there
    assert hosts.batches == MEMORY // MiB  # no batch of the layer went out
    _assert_forward(events)
    assert events[-1].outcome == "cancelled" and events[-1].where == "source" and events[-1].phase == "disk"


def test_cancel_before_the_save_leaves_the_guest_running_untouched():
    token, hosts, events = CancelToken(), FakeHosts(), []

    def listener(s: Snapshot) -> None:
        events.append(s)
        if s.phase == "balloon":
            token.cancel()

    with pytest.raises(MigrationCancelled) as info:
        migrate(object(), "vm", "http://b:7070", "t" * 20, steps=hosts, on_event=listener,  # type: ignore[arg-type]
                cancel=token, balloon="cache")
    assert info.value.restored and info.value.version == ""
    assert hosts.calls == ["balloon"] and hosts.running_here
    assert events[-1].outcome == "cancelled" and events[-1].where == "source"


def test_a_cancel_after_the_start_request_is_refused():
    token = CancelToken()
    hosts, events = FakeHosts(), []
    started = threading.Event()

    class Late(FakeHosts):
        def start_there(self, to, token_, name, number, fingerprint=None):
            started.set()
            assert not token.cancel()  # too late: the other host may be starting it
            return super().start_there(to, token_, name, number)

    hosts = Late()
    r = migrate(object(), "vm", "http://b:7070", "t" * 20, steps=hosts, on_event=events.append,  # type: ignore[arg-type]
                cancel=token)
    assert started.is_set() and r.last.outcome == "done" and not token.cancelled


def test_a_failed_push_is_a_failure_not_a_cancel():
    from capsule.errors import TransferFailed

    hosts, events = FakeHosts(fail_push=TransferFailed("bad block")), []
    with pytest.raises(MigrationFailed) as info:
        _migrate(hosts, events, mode="full")
    assert not isinstance(info.value, MigrationCancelled) and info.value.restored
    assert events[-1].outcome == "failed" and events[-1].where == "source"
