"""Faults in the middle of demand paging (issue 14), on a real guest (testkit/demandfaults.py): the disk server
SIGKILLed at random points of the guest's reads, and the link to the source reset and then half-open. Each
time the guest waits (QEMU's NBD client reconnects to the disk server the instance's watcher starts again;
the disk server retries the source) and then reads exactly the bytes the source holds; no I/O error reaches
the guest, and the store verifies clean."""

from __future__ import annotations

import pytest

from testkit import demandfaults

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

KILLS = 3


@pytest.fixture(scope="module")
def demand_run(tmp_path_factory, tiny_images):
    """One guest for the module's tests: each reads regions no other has read."""
    with demandfaults.demand_run(tmp_path_factory.mktemp("demand-faults"), tiny_images, KILLS + 2) as run:
        yield run


def test_a_disk_server_killed_at_random_points_is_started_again_and_the_guest_reads_the_same_bytes(demand_run):
    pids = [demand_run.server().pid]
    out = demandfaults.server_kills(demand_run, KILLS)
    assert out.injected == out.survived == KILLS, out.detail
    assert demand_run.revivals() == KILLS
    pids.append(demand_run.server().pid)
    assert pids[0] != pids[1] and demand_run.running()
    assert 0 < out.resent <= 2 * out.missing   # the regions came once each (and some read-ahead)


@pytest.mark.parametrize("fault", ["reset", "half-open"])
def test_a_link_fault_mid_demand_paging_leaves_the_guest_waiting_then_reading_the_same_bytes(demand_run, fault):
    out = demandfaults.link_fault(demand_run, fault)
    assert out.injected == out.survived == 1, out.detail
    assert demand_run.running()
