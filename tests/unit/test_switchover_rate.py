"""What a live move tells QEMU it can send in the pause (capsule/migrate/switchover.py): the raw bytes QEMU handed
the tunnel per second over the last seconds, not a burst the tunnel's buffers took."""

from __future__ import annotations

import pytest

from capsule.migrate.switchover import SwitchoverRate

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Flow:
    def __init__(self) -> None:
        self.t, self.raw, self.told = 0.0, 0, []

    def rate(self, refuse: bool = False) -> SwitchoverRate:
        def tell(r: int) -> bool:
            self.told.append(r)
            return not refuse
        return SwitchoverRate(None, lambda: self.raw, clock=lambda: self.t, tell=tell)

    def run(self, s: SwitchoverRate, seconds: float, per_second: int, step: float = 0.5) -> int | None:
        out = None
        for _ in range(int(seconds / step)):
            self.t += step
            self.raw += int(per_second * step)
            out = s.tick()
        return out


def test_a_burst_into_the_buffers_is_not_the_rate_the_flow_after_it_is():
    f = Flow()
    s = f.rate()
    assert s.tick() is None                       # nothing measured yet
    f.raw += 3_000_000                            # the buffers take 3 MB at once
    f.run(s, 10, 1_000_000)                       # then the link drains 1 MB/s
    assert f.told and abs(f.told[-1] - 1_000_000) < 50_000
    assert s.told == f.told[-1]


def test_qemu_is_told_again_only_when_the_rate_moves_and_never_after_it_refused():
    f = Flow()
    s = f.rate()
    f.run(s, 10, 1_000_000)
    told = len(f.told)
    f.run(s, 10, 1_030_000)                        # 3 %: not worth telling
    assert len(f.told) == told
    f.run(s, 10, 300_000)                          # the dirty pages compress worse now: told
    assert abs(f.told[-1] - 300_000) < 20_000

    g = Flow()
    r = g.rate(refuse=True)                        # a QEMU without avail-switchover-bandwidth
    g.run(r, 10, 1_000_000)
    assert len(g.told) == 1 and r.told is None and r.refused


def test_the_pages_are_credited_at_most_twice_the_links_rate():
    t, raw, wire, told = [0.0], [0], [0], []
    s = SwitchoverRate(None, lambda: raw[0], clock=lambda: t[0], tell=lambda r: told.append(r) or True,
                       wire=lambda: wire[0])
    for _ in range(20):                 # pages that compressed 4.7:1 over the window: 4.7 MB/s of them, 1 MB/s sent
        t[0] += 0.5
        raw[0] += 2_350_000
        wire[0] += 500_000
        s.tick()
    assert abs(told[-1] - 2_000_000) < 50_000          # the last pages may not compress as these did
    for _ in range(20):                 # pages that compress 1.5:1: their own rate
        t[0] += 0.5
        raw[0] += 750_000
        wire[0] += 500_000
        s.tick()
    assert abs(told[-1] - 1_500_000) < 50_000


def test_the_switchover_tail_counts_what_followed_the_guest_stopping():
    import os

    from capsule.migrate.ramdedup import Encoder
    from capsule.migrate.switchover import TailWatch
    from tests.helpers.migstream import StreamWriter

    w = StreamWriter().config().ram_start().ram_part()
    for i in range(40):
        w.page(os.urandom(4096), offset=i * 4096)
    w.eos()
    before = len(w.bytes())
    w.ram_part(end=True)
    for i in range(3):
        w.page(os.urandom(4096), offset=(100 + i) * 4096)
    w.eos()
    device_at = len(w.bytes())
    w.device(3, "cpu", b"\1" * 3000).end()
    data, now = w.bytes(), [0.0]
    channels = {"libvirt": 0, "qemu-migration": 0}
    enc, watch = Encoder(), TailWatch(clock=lambda: now[0], counters=lambda: dict(channels))
    wire_before_end = 0
    for at in range(0, len(data), 4096):
        channels["libvirt"] += 100
        enc.encode(data[at:at + 4096])
        watch.chunk(enc)
        if at <= before < at + 4096:
            at_stop = channels["libvirt"]
        if at + 4096 <= before:
            wire_before_end = enc.stats.wire_bytes
        now[0] += 0.1
    assert watch.tail is not None
    enc.finish()
    now[0] += 0.5
    watch.ended(enc)
    tail = watch.tail
    assert tail.memory_bytes == device_at - before and tail.memory_bytes > 3 * 4096
    assert tail.device_bytes == len(data) - device_at
    # the frames from the chunk holding the END on: the 3 random pages at least, none of the 40 before it
    assert 3 * 4096 < tail.wire_bytes <= enc.stats.wire_bytes - wire_before_end + 4096 + 64
    assert tail.wire_bytes < 10 * 4096
    assert tail.seconds > 0.5
    channels["libvirt"] += 7000                   # libvirt's finish calls, after the stream
    watch.settle()
    assert tail.channels["libvirt"] == channels["libvirt"] - at_stop and tail.channels["qemu-migration"] == 0


def test_no_tail_without_a_switchover():
    from capsule.migrate.ramdedup import Encoder
    from capsule.migrate.switchover import TailWatch
    from tests.helpers.migstream import StreamWriter

    enc, watch = Encoder(), TailWatch()
    enc.encode(StreamWriter().config().ram_start().ram_part().page(b"\2" * 4096).eos().bytes())
    watch.chunk(enc)
    enc.finish()
    watch.ended(enc)
    assert watch.tail is None
