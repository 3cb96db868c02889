"""A push that is told to stop (a cancelled migration) stops between batches, queued batches never go out,
and a later push finishes the job; the progress callbacks a migration draws from (object, local)."""

from __future__ import annotations

import pytest

from capsule import transfer
from capsule.errors import Cancelled
from tests.tools.test_transfer_agent import hosts  # noqa: F401 - fixture

pytestmark = [pytest.mark.tools, pytest.mark.timeout(300)]


class Recorder(transfer.Progress):
    def __init__(self) -> None:
        self.objects: list[tuple[str, str, int, bool]] = []
        self.done = self.found = self.wire_total = 0

    def object(self, kind, oid, role, raw_bytes, present):
        self.objects.append((kind, role, raw_bytes, present))

    def advance(self, n):
        self.done += n

    def local(self, n):
        self.found += n

    def wire(self, total_wire):
        self.wire_total = max(self.wire_total, total_wire)


def test_a_cancelled_push_stops_between_batches_and_a_later_one_finishes(hosts):  # noqa: F811
    a, b, _agent_a, agent_b = hosts
    opts = transfer.Options(batch=16, inflight=2)
    checks = [0]

    def check() -> None:
        checks[0] += 1
        if checks[0] > 4:
            raise Cancelled("the migration was cancelled")

    first = Recorder()
    with pytest.raises(Cancelled):
        transfer.push(a, "cap", agent_b.url, agent_b.token, opts, first, check=check)
    assert b.catalogue.latest_version("cap") is None            # nothing recorded
    layer = a.catalogue.latest_version("cap").chains[0][0]
    raw = first.objects[0][2]
    assert first.objects[0][:2] == ("layer", "layer") and raw > 0
    assert 0 < first.done < raw                                 # it stopped in the middle of the layer
    sent_before = first.wire_total

    again = Recorder()
    r = transfer.push(a, "cap", agent_b.url, agent_b.token, opts, again)
    assert r.recorded and b.catalogue.layer(layer) is not None
    # every object announced once, in order; the raw bytes all accounted for, part of them found there
    assert [o[1] for o in again.objects] == ["layer", "kernel", "initrd"]
    assert again.done == sum(o[2] for o in again.objects)
    assert again.found == sum(o.cache_bytes for o in r.objects) + sum(o[2] for o in again.objects if o[3])
    assert sent_before > 0 and again.wire_total > 0
