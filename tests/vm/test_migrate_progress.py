"""A migration's phases and its cancel on a real tiny guest between two stores and two agents: the events the
CLI and the dashboard draw, in order and only forward, and a cancel that leaves the guest running at the
source with its counter going on."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from capsule.migrate import MigrationCancelled, migrate
from capsule.migrateprogress import CancelToken, Snapshot
from capsule.runtime.connection import lookup_domain
from tests.vm.helpers import COUNTER, count, run, wait_count_above, write_blocks

pytestmark = [pytest.mark.vm, pytest.mark.timeout(400)]


def _forward(events: list[Snapshot]) -> None:
    for before, after in zip(events, events[1:], strict=False):
        assert after.seq > before.seq and after.index >= before.index
        assert after.wire_bytes >= before.wire_bytes and after.local_bytes >= before.local_bytes
        assert after.done_bytes >= before.done_bytes


def _running_counter(store, name: str) -> int:
    capsules.create(store, name, "tiny", memory="256M")
    lifecycle.start(store, name)
    run(store, name, COUNTER)
    write_blocks(store, name, 700, 64)  # a disk layer of its own to move
    return wait_count_above(store, name, 5)


@pytest.mark.parametrize("mode", ["full", "demand"])
def test_the_phases_come_in_order_and_the_guest_goes_on_at_the_destination(two_hosts, mode):
    a, b, agent_a, agent_b = two_hosts
    before = _running_counter(a, "p")
    events: list[Snapshot] = []
    r = migrate(a, "p", agent_b.url, agent_b.token, mode=mode, balloon="cache", source_url=agent_a.url,
                source_token=agent_a.token, on_event=events.append, to_name="b")
    want = ["balloon", "save", "memory", "disk", "resume"] if mode == "full" else ["balloon", "save", "memory",
                                                                                    "resume"]
    assert list(dict.fromkeys(e.phase for e in events if e.phase)) == want
    _forward(events)
    last = events[-1]
    assert last is r.last and last.outcome == "done" and last.where == "destination" and last.version == "p@2"
    assert last.done_bytes == last.total_bytes > 0 and last.wire_bytes > 0
    # the destination held the tiny image already: its kernel and initrd (and in full mode the root layer)
    # were found there, not sent
    assert last.local_bytes > 0
    assert lookup_domain(a.domain_name("p")) is None and lookup_domain(b.domain_name("p")) is not None
    after = count(b, "p")
    assert before <= after < before + 40
    assert wait_count_above(b, "p", after) > after


def test_cancel_mid_transfer_leaves_the_guest_running_at_the_source(two_hosts):
    a, b, _agent_a, agent_b = two_hosts
    before = _running_counter(a, "c")
    token = CancelToken()
    events: list[Snapshot] = []

    def listener(s: Snapshot) -> None:
        events.append(s)
        if s.phase == "disk":  # the memory image went over; stop in the middle of the disks
            token.cancel()

    with pytest.raises(MigrationCancelled) as info:
        migrate(a, "c", agent_b.url, agent_b.token, on_event=listener, cancel=token, to_name="b")
    err = info.value
    assert err.restored and err.version == "c@2" and err.step == "push"
    _forward(events)
    assert events[-1].outcome == "cancelled" and events[-1].where == "source" and events[-1].phase == "disk"
    assert b.catalogue.version("c", 2) is None            # never recorded there, never started there
    assert lookup_domain(b.domain_name("c")) is None
    assert lookup_domain(a.domain_name("c")) is not None
    assert a.catalogue.instance("c").version == 2
    after = count(a, "c")
    assert before <= after < before + 40
    assert wait_count_above(a, "c", after) > after
