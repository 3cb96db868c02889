"""testkit.guestclock: a pause shows as the growth of host time − guest uptime, not in the guest's own stamps."""

from __future__ import annotations

import pytest

from testkit.guestclock import offset, paused

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class FakeGuest:
    """A host clock the test moves, and a guest whose uptime stands still while it is paused."""

    def __init__(self) -> None:
        self.host = 1000.0
        self.uptime = 5.0
        self.round_trip = 0.2

    def clock(self) -> float:
        return self.host

    def run(self, command: str) -> str:
        assert command == "cat /proc/uptime"
        self.host += self.round_trip / 2
        self.uptime += self.round_trip / 2
        out = f"{self.uptime:.2f} 1.00\n"
        self.host += self.round_trip / 2
        self.uptime += self.round_trip / 2
        return out

    def runs(self, seconds: float) -> None:
        self.host += seconds
        self.uptime += seconds

    def paused_for(self, seconds: float) -> None:
        self.host += seconds


def test_a_pause_is_the_growth_of_the_offset_and_running_time_is_not():
    g = FakeGuest()
    before = offset(g.run, clock=g.clock)
    g.runs(30.0)
    g.paused_for(0.7)
    g.runs(12.0)
    seconds, error = paused(before, offset(g.run, clock=g.clock))
    assert abs(seconds - 0.7) <= error
    assert error < 0.25


def test_the_best_sample_is_the_one_with_the_shortest_round_trip():
    g = FakeGuest()
    trips = iter([2.0, 0.02, 1.0])

    def run(command: str) -> str:
        g.round_trip = next(trips)
        return g.run(command)

    assert offset(run, clock=g.clock).error == pytest.approx(0.01 + 0.01)


def test_an_answer_without_an_uptime_is_an_error():
    with pytest.raises(ValueError, match="no uptime"):
        offset(lambda _c: "sh: cat: not found", clock=lambda: 0.0)
