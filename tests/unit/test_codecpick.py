"""The codec picked by the link (capsule/transfer/codecpick.py): for given measured rates and ratios the
picker sends what keeps the link full with the fewest bytes, does not flap, stays within what the
receiver takes, and a codec the user gave wins; the link meter (capsule/transfer/pacing.py) counts only
the time requests were in flight."""

from __future__ import annotations

import random
import time

import pytest

from capsule import transfer
from capsule.transfer import codecpick, pulling, pushing
from capsule.transfer.codecpick import NONE, XZ, ZSTD3, Codec, CodecPicker
from capsule.transfer.pacing import LinkMeter, Pacer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

MB = 1e6
Z19 = Codec("zstd", 19)
Z10 = Codec("zstd", 10)
ALL = codecpick.candidates({"zstd", "xz"}, pushing.STREAM_LEVEL)
# measured on a transfer's data (ratio: wire per raw byte; speed: raw bytes/s on one thread)
Z13, Z16 = Codec("zstd", 13), Codec("zstd", 16)
MEASURED = {ZSTD3: (0.45, 300 * MB), Z10: (0.38, 40 * MB), Z13: (0.37, 20 * MB), Z16: (0.35, 6 * MB),
            Z19: (0.33, 3 * MB), XZ: (0.30, 2.5 * MB), NONE: (1.0, 0)}


def picker(link: float | None, measured: dict[Codec, tuple[float, float]] = MEASURED, **kw) -> CodecPicker:
    rate = {"link": link}
    p = CodecPicker(lambda: rate["link"], parallel=2, **kw)
    p.rate = rate   # type: ignore[attr-defined]  # the test changes the link under it
    for codec, (ratio, speed) in measured.items():
        raw = 1 << 20
        p.record(codec, raw, int(raw * ratio), raw / speed if speed else None)
    return p


def test_a_slow_link_gets_xz_a_fast_one_zstd_3():
    assert picker(48_000).choose(ALL) == XZ                 # 384 kbit/s: every codec waits for the link
    assert picker(0.5 * MB).choose(ALL) == XZ               # 4 Mbit/s: xz's 2.5 MB/s still outruns it
    assert picker(125 * MB).choose(ALL) == ZSTD3            # a LAN: only zstd -3 keeps up
    assert picker(400 * MB).choose(ALL) == ZSTD3            # 2 × 300 MB/s of zstd -3 fills it: fewer bytes
    assert picker(1000 * MB).choose(ALL) == NONE            # loopback: faster than 2 threads of zstd -3


def test_incompressible_data_on_a_fast_link_goes_as_it_is():
    random_data = {ZSTD3: (1.0, 900 * MB), Z19: (1.0, 50 * MB), XZ: (1.0, 10 * MB), NONE: (1.0, 0)}
    assert picker(1000 * MB, random_data).choose(ALL) == NONE


def test_a_cpu_slower_than_the_link_gets_a_faster_codec():
    # 20 Mbit/s = 2.5 MB/s: xz would deliver 2.5 MB/s of raw data (its CPU), zstd -13 2.5/0.37 = 6.8 MB/s
    assert picker(2.5 * MB).choose(ALL) == Z13
    slow_cpu = {c: (r, s / 10) for c, (r, s) in MEASURED.items()}
    assert picker(2.5 * MB, slow_cpu).choose(ALL) == ZSTD3   # a tenth of the CPU: only zstd -3 keeps up


def test_near_equal_rates_prefer_fewer_bytes():
    # 1 MB/s: zstd -16 delivers 1/0.35 = 2.86 MB/s, xz min(2.5, 3.33) = 2.5 MB/s: 13 % less -> not near
    base = {**MEASURED, Z19: (0.33, 2 * MB)}
    assert picker(1 * MB, base).choose(ALL) == Z16
    near = {**base, XZ: (0.30, 2.7 * MB)}              # xz 2.7 MB/s: within 10 % of 2.86 -> fewer bytes
    assert picker(1 * MB, near).choose(ALL) == XZ


def test_the_codec_in_use_stays_until_another_is_clearly_better():
    assert picker(0.92 * MB).choose(ALL) == Z19   # at 0.92 MB/s zstd -19 delivers 2.79 MB/s, xz 2.5 MB/s
    p = picker(0.5 * MB)
    assert p.choose(ALL) == XZ
    p.rate["link"] = 0.92 * MB             # zstd -19 only 11 % better than xz, which is in use: xz stays
    assert [p.choose(ALL) for _ in range(5)] == [XZ] * 5
    p.rate["link"] = 100 * MB              # a fast link now: zstd -3 delivers 90 times more
    assert p.choose(ALL) == ZSTD3
    p.rate["link"] = 500 * MB              # none delivers 500 MB/s, zstd -3 its 600 (fewer bytes): it stays
    assert p.choose(ALL) == ZSTD3
    p.rate["link"] = 1 * MB                # and slow again
    assert p.choose(ALL) == Z19


def test_only_codecs_the_receiver_takes():
    assert codecpick.candidates(set(), pushing.STREAM_LEVEL) == [NONE, ZSTD3]     # no streams: frames only
    assert XZ not in codecpick.candidates({"zstd"}, pushing.STREAM_LEVEL)
    assert picker(48_000).choose(codecpick.candidates({"zstd"}, pushing.STREAM_LEVEL)) == Z19
    assert picker(48_000).choose(codecpick.candidates(set(), pushing.STREAM_LEVEL)) == ZSTD3
    pulled = codecpick.candidates((), pulling.STREAM_LEVEL_PULL, streams=False)   # a pull: frames at any level
    assert XZ not in pulled and Z19 in pulled and not any(c.is_stream(pulling.STREAM_LEVEL_PULL) for c in pulled)


def test_overrides_win():
    def forced(opts: transfer.Options, offered: set[str], link: float) -> Codec:
        p = opts.picker(pushing.STREAM_LEVEL)
        p.link = lambda: link
        return p.choose(codecpick.candidates(offered, pushing.STREAM_LEVEL))

    assert transfer.Options().codec == "auto"
    assert forced(transfer.Options(level=3), {"zstd", "xz"}, 48_000) == ZSTD3          # slow link, zstd -3 given
    assert forced(transfer.Options(xz=True), {"zstd", "xz"}, 1e9) == XZ                 # fast link, xz given
    assert forced(transfer.Options(xz=True), {"zstd"}, 48_000) == ZSTD3                 # no xz there: zstd 3
    assert forced(transfer.Options(xz=True, level=19), {"zstd"}, 48_000) == Z19
    assert forced(transfer.Options(compress=False), {"zstd", "xz"}, 48_000) == NONE
    assert transfer.Options(level=19).codec == "zstd" and transfer.Options(compress=False).codec == "none"


def test_probes_measure_each_candidate_then_only_now_and_then():
    p = CodecPicker(lambda: None)
    data = random.Random(1).randbytes(1 << 16) * 4     # compressible: a 64 KiB pattern four times
    probed: list[Codec | None] = []
    for _ in range(len(ALL) - 1 + 3 * codecpick.PROBE_EVERY):
        due = p.probe_due(ALL)
        probed.append(due)
        if due is not None:
            p.measure(due, data)
    first = probed[:len(ALL) - 1]
    assert set(first) == set(ALL) - {NONE}             # every candidate once at the start
    later = [c for c in probed[len(ALL) - 1:] if c is not None]
    assert 0 < len(later) <= 4                         # then one every PROBE_EVERY batches
    assert p.ratio(XZ) < 0.5 and p.ratio(ZSTD3) < 0.5  # the repeat found
    assert p.choose(ALL) == ZSTD3                      # nothing measured of the link yet: today's default


def test_the_link_meter_counts_only_time_with_requests_in_flight():
    meter = LinkMeter()
    assert meter.rate() is None
    for _ in range(3):
        meter.started()
        time.sleep(0.05)
        meter.ended(50_000)            # 50 kB in 50 ms on the wire: 1 MB/s
        time.sleep(0.1)                # the sender compressing, nothing on the wire
    assert 0.7 * MB < (meter.rate() or 0) < 1.05 * MB
    meter.started()
    meter.started()                    # two at once: their time counts once
    time.sleep(0.05)
    meter.ended(50_000)
    meter.ended(50_000)
    assert 0.9 * MB < (meter.rate() or 0) < 1.4 * MB


def test_pacers_of_a_transfer_feed_its_meter():
    meter = LinkMeter()
    for _ in range(2):                 # two objects, one pacer each
        pacer = Pacer(16, 2, meter=meter)
        with pacer.flight(16) as sent:
            time.sleep(0.02)
            sent.append(20_000)
    assert meter.rate() is not None and meter.rate() > 0.3 * MB
