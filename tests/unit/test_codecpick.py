"""The codec picked by the link (capsule/transfer/codecpick.py): for given measured rates and ratios the
picker sends what arrives soonest, and of what keeps the link full the fewest bytes; it never picks a
codec whose CPU is the limit when a faster one exists (xz on a 20 Mbit/s link), counts the receiver's
decoding, believes the encode times of the batches it sent over its probes, does not flap, stays within what
the receiver takes, and a codec the user gave wins; the link meter (capsule/transfer/pacing.py) counts only
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
# measured on a transfer's data: ratio (wire per raw byte), compress and decompress speed (raw bytes/s, one
# thread), about as this 2-core machine does them
Z13, Z16 = Codec("zstd", 13), Codec("zstd", 16)
MEASURED = {ZSTD3: (0.45, 300 * MB, 600 * MB), Z10: (0.38, 40 * MB, 600 * MB), Z13: (0.37, 20 * MB, 600 * MB),
            Z16: (0.35, 6 * MB, 600 * MB), Z19: (0.33, 3 * MB, 600 * MB), XZ: (0.30, 2.5 * MB, 100 * MB)}
Measured = dict[Codec, tuple[float, float, float]]
RAW = 1 << 18


def picker(link: float | None, measured: Measured = MEASURED, **kw) -> CodecPicker:
    """A picker that probed each codec once with the figures ``measured`` on a link of ``link`` bytes/s."""
    rate = {"link": link}
    p = CodecPicker(lambda: rate["link"], parallel=2, **kw)
    p.rate = rate   # type: ignore[attr-defined]  # the test changes the link under it
    reference = int(RAW * measured.get(ZSTD3, (1.0, 0, 0))[0])
    for codec, (ratio, speed, decode) in measured.items():
        p.record_probe(codec, RAW, int(RAW * ratio), reference, RAW / speed, RAW / decode)
    return p


def seconds(p: CodecPicker, codec: Codec) -> float:
    e = p.expected(codec, p.link() or 0)
    assert e is not None
    return e.seconds


def test_a_slow_link_gets_xz_a_fast_one_zstd_3_or_nothing():
    assert picker(48_000).choose(ALL) == XZ                 # 384 kbit/s: every codec waits for the link
    assert picker(0.5 * MB).choose(ALL) == XZ               # 4 Mbit/s: xz's 2.5 MB/s still outruns it
    assert picker(125 * MB).choose(ALL) == ZSTD3            # a LAN: only zstd -3 keeps up
    assert picker(1000 * MB).choose(ALL) == NONE            # loopback: faster than 2 threads of zstd -3
    no_xz = codecpick.candidates({"zstd"}, pushing.STREAM_LEVEL)
    assert picker(48_000).choose(no_xz) == Z19              # a receiver without xz: the smallest zstd


def test_incompressible_data_on_a_fast_link_goes_as_it_is():
    random_data = {ZSTD3: (1.0, 900 * MB, 2000 * MB), Z19: (1.0, 50 * MB, 2000 * MB), XZ: (1.0, 10 * MB, 2000 * MB)}
    assert picker(1000 * MB, random_data).choose(ALL) == NONE
    assert picker(48_000, random_data).choose(ALL) == NONE   # nothing to gain on a slow link either


def test_where_the_cpu_is_the_limit_xz_is_never_picked():
    # 20 Mbit/s = 2.5 MB/s: xz would compress 2.5 MB/s of raw data (its CPU), zstd -13 sends 2.5/0.37 = 6.8 MB/s
    p = picker(2.5 * MB)
    assert p.choose(ALL) == Z13
    assert seconds(p, Z13) < seconds(p, ZSTD3) < seconds(p, XZ)
    slow_cpu = {c: (r, s / 10, d / 10) for c, (r, s, d) in MEASURED.items()}
    assert picker(2.5 * MB, slow_cpu).choose(ALL) == ZSTD3   # a tenth of the CPU: only zstd -3 keeps up
    much_smaller = {**MEASURED, XZ: (0.15, 2.5 * MB, 100 * MB)}   # half zstd -19's bytes, but the CPU limits it
    assert picker(2.5 * MB, much_smaller).choose(ALL) != XZ


@pytest.mark.parametrize("kbit", [256, 384, 1000, 4000, 8000, 20_000, 50_000, 100_000, 1_000_000, 10_000_000])
def test_never_slower_than_zstd_3_and_xz_only_where_the_link_is_full(kbit):
    for measured in (MEASURED, {c: (r, s / 4, d / 4) for c, (r, s, d) in MEASURED.items()}):
        p = picker(kbit * 125, measured)
        pick = p.choose(ALL)
        assert seconds(p, pick) <= 1.03 * seconds(p, ZSTD3), (kbit, pick)
        cost = p.expected(pick, kbit * 125)
        assert cost is not None and cost.ratio <= p.expected(ZSTD3, kbit * 125).ratio or pick == NONE
        if pick == XZ:
            assert cost.link_full, kbit


def test_the_receivers_decoding_counts():
    # 4 Mbit/s, xz's compression keeps up, but a receiver decoding only 1 MB/s would not
    slow_decode = {**MEASURED, XZ: (0.30, 2.5 * MB, 1 * MB)}
    assert picker(0.5 * MB).choose(ALL) == XZ
    assert picker(0.5 * MB, slow_decode).choose(ALL) == Z19


def test_encode_times_of_the_batches_sent_overrule_an_optimistic_probe():
    # the probe saw xz compress 12 MB/s (an idle moment, a small sample): at 20 Mbit/s xz looks best
    optimistic = {**MEASURED, XZ: (0.30, 12 * MB, 100 * MB)}
    p = picker(2.5 * MB, optimistic)
    assert p.choose(ALL) == XZ
    p.record(XZ, 1 << 20, int(0.30 * (1 << 20)), (1 << 20) / (2 * MB))   # a batch sent took 2 MB/s
    assert p.choose(ALL) == Z13


def test_no_stream_starts_before_every_candidate_is_measured():
    some = {ZSTD3: MEASURED[ZSTD3], Z19: MEASURED[Z19]}
    assert picker(48_000, some).choose(ALL) == ZSTD3        # xz and the others not probed yet: frames
    assert picker(48_000, some).choose([NONE, ZSTD3, Z19]) == Z19


def test_fewer_bytes_win_only_where_the_link_is_full():
    # a stream waits a round trip per batch: zstd -10 (a stream) sends 2 % fewer bytes than zstd -3 frames,
    # but over 4 Mbit/s with 1 MiB batches its round trips make it 1 % slower: fewer bytes, the link full
    measured = {ZSTD3: (0.45, 300 * MB, 600 * MB), Z10: (0.44, 40 * MB, 600 * MB)}
    allowed = [NONE, ZSTD3, Z10]
    p = picker(0.5 * MB, measured)
    p.record(ZSTD3, 1 << 20, int(0.45 * (1 << 20)))   # a batch sent: 1 MiB
    assert seconds(p, ZSTD3) < seconds(p, Z10) <= 1.03 * seconds(p, ZSTD3)
    assert p.expected(Z10, 0.5 * MB).link_full and p.choose(allowed) == Z10
    # the same, but zstd -10's CPU is the limit: the fastest wins
    slow = {ZSTD3: (0.45, 300 * MB, 600 * MB), Z10: (0.44, 1.36 * MB, 600 * MB)}
    q = picker(0.5 * MB, slow)
    q.record(ZSTD3, 1 << 20, int(0.45 * (1 << 20)))
    assert seconds(q, ZSTD3) < seconds(q, Z10) <= 1.03 * seconds(q, ZSTD3)
    assert not q.expected(Z10, 0.5 * MB).link_full and q.choose(allowed) == ZSTD3


def test_the_codec_in_use_stays_until_another_is_clearly_faster():
    two = {ZSTD3: MEASURED[ZSTD3], Z19: MEASURED[Z19]}
    allowed = [NONE, ZSTD3, Z19]
    p = picker(1.0 * MB, two)              # zstd -19's CPU (3 MB/s) is faster than zstd -3 over 1 MB/s
    assert p.choose(allowed) == Z19
    p.rate["link"] = 1.09 * MB             # zstd -3 now 1.5 % faster: zstd -19 stays
    assert seconds(p, ZSTD3) < seconds(p, Z19) < 1.03 * seconds(p, ZSTD3)
    assert [p.choose(allowed) for _ in range(5)] == [Z19] * 5
    p.rate["link"] = 1.2 * MB              # 11 % faster: it changes
    assert p.choose(allowed) == ZSTD3
    p.rate["link"] = 0.2 * MB              # and slow again
    assert p.choose(allowed) == Z19


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
    link: dict[str, float | None] = {"rate": None}
    p = CodecPicker(lambda: link["rate"])
    data = random.Random(1).randbytes(1 << 16) * 4     # compressible: a 64 KiB pattern four times
    assert p.probe_due(ALL) is None                    # nothing before the link's first answers
    link["rate"] = 48_000.0                            # a slow link: every candidate may win
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
    link["rate"] = None
    assert p.choose(ALL) == ZSTD3                      # nothing measured of the link: today's default


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


def test_no_stream_before_the_link_is_measured_for_a_few_seconds():
    p = picker(48_000)
    p.settled = lambda: False          # the window still opening: its rate says little of the link
    assert p.choose(ALL) == ZSTD3
    p.settled = lambda: True
    assert p.choose(ALL) == XZ
    meter = LinkMeter(span_s=0.2)
    meter.started()
    time.sleep(0.05)
    meter.ended(10_000)
    assert not meter.settled()
    meter.started()
    time.sleep(0.2)
    meter.ended(10_000)
    assert meter.settled()


def test_a_stream_in_use_is_left_only_for_a_clearly_faster_codec():
    two = {ZSTD3: MEASURED[ZSTD3], Z19: MEASURED[Z19]}
    allowed = [NONE, ZSTD3, Z19]
    p = picker(1.15 * MB, two)         # zstd -3 about 5 % faster than the zstd -19 stream in use: it stays
    assert seconds(p, ZSTD3) * 1.03 < seconds(p, Z19) < 1.10 * seconds(p, ZSTD3)
    assert p.choose(allowed) == ZSTD3 and p.choose(allowed, keep=Z19) == Z19
    p.rate["link"] = 1.5 * MB          # 28 % faster: it is left
    assert p.choose(allowed, keep=Z19) == ZSTD3


def test_a_streams_history_is_judged_against_the_batch_sent_before():
    rng = random.Random(7)
    prior, alike = rng.randbytes(1 << 16), rng.randbytes(1 << 16)

    def probed(before: bytes) -> CodecPicker:
        p = CodecPicker(lambda: 48_000.0)
        for codec in (ZSTD3, Z19):
            p.measure(codec, prior + alike, before)
        return p

    fresh, after = probed(b""), probed(prior)   # the same data, seen before by a stream or not
    assert fresh.ratio(Z19) > 0.9 and abs(fresh.ratio(Z19) - fresh.ratio(ZSTD3)) < 0.05
    assert after.ratio(Z19) < 0.7 * after.ratio(ZSTD3)   # a stream would send half of it: frames all of it


def test_a_stream_is_judged_by_its_segments_with_history_each_against_its_own_batch():
    """A stream's first segment has no history: it must not judge the stream (a push at 1 Mbit/s whose text
    went as 0.39 of itself in a stream's first segment and 0.06 in the next ones went back to zstd -3
    frames for good). Its later segments judge it, each against zstd -3 on its own batch: against the
    probes' average, a batch of random data after text counted twice what was expected."""
    p = picker(125_000, {ZSTD3: (0.35, 300 * MB, 600 * MB), Z16: (0.25, 6 * MB, 600 * MB)})
    allowed = [NONE, ZSTD3, Z16]
    p.record(Z16, 1 << 16, int(0.39 * (1 << 16)), 0.01, sample=0.35, first=True)
    assert p.choose(allowed, keep=Z16) == Z16       # judged by the history a stream is expected to have
    assert p.ratio(Z16) == pytest.approx(0.25, rel=0.01)
    noise = random.Random(5).randbytes(1 << 18)
    assert CodecPicker.yardstick(noise) > 0.99
    # random data: no codec compresses it, so the stream did as expected (as 0.25 / 0.35 of frames, it
    # would have counted 1.4 times worse than expected, and worse than frames)
    p.record(Z16, 1 << 18, 1 << 18, 0.04, CodecPicker.yardstick(noise))
    assert p.ratio(Z16) == pytest.approx(0.25, rel=0.01) and p.choose(allowed, keep=Z16) == Z16
    for _ in range(3):                              # text the stream has seen the like of
        p.record(Z16, 1 << 18, int(0.06 * (1 << 18)), 0.04, sample=0.35)
    assert p.ratio(Z16) < 0.6 * p.ratio(ZSTD3)
    assert p.choose(allowed) == Z16 and p.choose(allowed, keep=Z16) == Z16


def test_on_a_fast_link_codecs_that_cannot_win_are_not_probed():
    p = CodecPicker(lambda: 1000 * MB, parallel=2)    # loopback
    data = random.Random(2).randbytes(1 << 16) * 4
    p.record_probe(ZSTD3, 1 << 18, 1 << 16, 1 << 16, (1 << 18) / (400 * MB), (1 << 18) / (800 * MB))
    p.record_probe(Z10, 1 << 18, 1 << 16, 1 << 16, (1 << 18) / (30 * MB), (1 << 18) / (800 * MB))
    assert p.hopeless(ALL, 1000 * MB) == set(ALL) - {NONE, ZSTD3}   # zstd -10's CPU is 30x too slow
    probed = [p.probe_due(ALL) for _ in range(3 * codecpick.PROBE_EVERY)]
    assert set(probed) <= {None, ZSTD3}                # no probe of zstd -13 and up, nor of xz
    assert p.choose(ALL) in (NONE, ZSTD3)              # and the choice does not wait for them
    slow = CodecPicker(lambda: 48_000.0, parallel=2)   # a slow link: zstd -10 can win, the rest are probed
    slow.measure(ZSTD3, data)
    slow.measure(Z10, data)
    assert not slow.hopeless(ALL, 48_000.0)
