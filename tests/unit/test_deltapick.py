"""Deltas picked by the link (capsule/transfer/deltapick.py): a delta's CPU (finding, encoding, the
receiver's rebuilding) and its bytes enter the codec picker's ``max(cpu, ratio / link)``; deltas are used
where they send a slice sooner than whole blocks in the codec picked, declined on a fast link, measured by a
trial first and tried again less and less often once declined; zstd -19 deltas where the link is slow
enough for their CPU, -12 where not, -19 measured only where -12 keeps the link full."""

from __future__ import annotations

import pytest

from capsule.transfer import codecpick, deltapick, pushing
from capsule.transfer.codecpick import CPU_MARGIN, XZ, ZSTD3, CodecPicker, Expected
from capsule.transfer.deltapick import ALL, NONE, TRIAL, DeltaCost, DeltaPick, Plan

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

MB = 1e6
RAW = 1 << 20
ALLOWED = codecpick.candidates({"zstd", "xz"}, pushing.STREAM_LEVEL)
# B1-like figures: zstd -3 and xz on package files; deltas found for 60 % of the bytes tried, a tenth of
# their bytes at zstd -12 (searched and encoded at 25 MB/s), a twentieth at -19 (2.5 MB/s), rebuilt at
# 200 MB/s
CODECS = {ZSTD3: (0.45, 300 * MB, 600 * MB), XZ: (0.30, 2.5 * MB, 100 * MB)}
FIND, DECODE, SHARE, RATIO = 1 / (25 * MB), 1 / (200 * MB), 0.6, 0.1
FIND19, RATIO19 = 1 / (2.5 * MB), 0.05


def _pick(link: float | None) -> DeltaPick:
    rate = {"link": link}
    p = CodecPicker(lambda: rate["link"], parallel=2)
    reference = int(RAW * CODECS[ZSTD3][0])
    for codec, (ratio, speed, decode) in CODECS.items():
        p.record_probe(codec, RAW, int(RAW * ratio), reference, RAW / speed, RAW / decode)
    pick = DeltaPick(p)
    pick.rate = rate   # type: ignore[attr-defined]  # the test changes the link under it
    return pick


def _measured(pick: DeltaPick, share: float = SHARE, level: int = 12) -> DeltaPick:
    find, ratio = (FIND, RATIO) if level == 12 else (FIND19, RATIO19)
    pick.record(RAW, int(RAW * share), int(RAW * share * ratio), RAW * find, RAW * DECODE, level)
    return pick


def test_the_arithmetic_of_a_slice_with_deltas():
    whole = Expected(cpu=0.002e-6, wire=0.45 / (2.5 * MB), ratio=0.45)
    cost = DeltaCost(find=FIND, decode=DECODE, share=SHARE, ratio=RATIO)
    e = cost.expected(whole, 2.5 * MB)
    assert e.cpu == pytest.approx(CPU_MARGIN * (FIND + DECODE) + 0.4 * whole.cpu)
    assert e.ratio == pytest.approx(0.6 * 0.1 + 0.4 * 0.45)
    assert e.wire == pytest.approx(e.ratio / (2.5 * MB)) and e.seconds == max(e.cpu, e.wire)


def test_measurements_are_per_raw_byte_tried():
    pick = _measured(_pick(2.5 * MB))
    assert pick.cost is not None
    assert [pick.cost.find, pick.cost.decode, pick.cost.share, pick.cost.ratio] == pytest.approx(
        [FIND, DECODE, SHARE, RATIO], rel=1e-3)
    pick.record(RAW, 0, 0, RAW * FIND)   # a slice where nothing paid: the share falls, the rest stays
    assert pick.cost is not None and pick.cost.share == pytest.approx(0.7 * SHARE, rel=1e-3)
    assert pick.cost.ratio == pytest.approx(RATIO, rel=1e-3) and pick.cost.decode == pytest.approx(DECODE)


@pytest.mark.parametrize(("kbit", "codec", "used"), [
    (384, XZ, True), (20_000, XZ, True), (20_000, ZSTD3, True),
    (1_000_000, ZSTD3, False), (8_000_000, codecpick.NONE, False)])
def test_deltas_where_they_send_sooner(kbit, codec, used):
    pick = _measured(_pick(kbit * 1000 / 8))
    assert pick.next_slice(codec).mode == (ALL if used else NONE)   # just measured: no trial again yet
    assert pick.decision == ("used" if used else "declined"), pick.figures
    with_, without = pick.figures["with_s_per_mb"], pick.figures["without_s_per_mb"]
    assert (with_ < without) == used, pick.figures
    assert pick.figures["with_ratio"] < pick.figures["without_ratio"]   # fewer bytes either way


def test_deltas_that_save_no_bytes_never_pay():
    pick = _measured(_pick(48_000), share=0.0)
    assert pick.next_slice(XZ).mode == NONE and pick.decision == "declined"


def test_a_trial_first_then_tries_again_less_and_less_often():
    pick = _pick(None)
    assert pick.next_slice(ZSTD3) == Plan(TRIAL, 12) and pick.decision == ""   # nothing measured: a trial
    _measured(pick)
    assert pick.next_slice(ZSTD3).mode == TRIAL                       # the link not measured yet
    pick.rate["link"] = 1000 * MB                                     # type: ignore[attr-defined]
    plan = []
    for _ in range(60):
        step = pick.next_slice(ZSTD3).mode
        plan.append(step)
        if step == TRIAL:
            _measured(pick)
    assert pick.decision == "declined" and ALL not in plan
    trials = [k for k, step in enumerate(plan) if step == TRIAL]
    gaps = [b - a for a, b in zip(trials, trials[1:], strict=False)]
    assert gaps == [2 * deltapick.RETRY_SLICES, 4 * deltapick.RETRY_SLICES], plan
    pick.rate["link"] = 48_000                                        # type: ignore[attr-defined]
    assert pick.next_slice(ZSTD3).mode == ALL and pick.decision == "used"  # the link slowed down


def test_the_level_that_sends_soonest_and_the_smaller_one_measured_only_where_the_link_is_full():
    fast = _measured(_pick(20_000 * 1000 / 8))
    plan = fast.next_slice(ZSTD3)
    assert plan == Plan(ALL, 12, 19), fast.figures       # -12 keeps the link full: -19 measured on a part
    _measured(fast, level=19)
    assert fast.next_slice(ZSTD3) == Plan(ALL, 12)       # -19's CPU is the limit at 20 Mbit/s
    later = [fast.next_slice(ZSTD3) for _ in range(3 * deltapick.RETRY_SLICES)]
    assert set(later) == {Plan(ALL, 12)}                 # and cannot win: not measured again
    slow = _measured(_measured(_pick(48_000)), level=19)
    assert slow.next_slice(XZ) == Plan(ALL, 19) and slow.figures["level"] == 19, slow.figures
    assert slow.figures["with_ratio"] < 0.6 * RATIO + 0.4 * 0.30   # fewer bytes than -12's
    busy = _measured(_pick(48_000))
    busy.costs[12].find = 1 / (0.25 * MB)                # -12's CPU is the limit: nothing slower is measured
    assert busy.next_slice(XZ) == Plan(ALL, 12), busy.figures


def test_the_file_systems_are_read_for_a_trial_only_where_that_pays():
    """Reading both versions' file systems (once per object) is a fixed cost: made for a trial only once
    the link is measured and where it takes at most OPEN_SHARE of the time the object's rest takes whole."""
    assert _pick(None).next_slice(ZSTD3, 64 * RAW, opened=False).mode == NONE
    slow, fast = _pick(20_000 * 1000 / 8), _pick(1000 * MB)
    assert slow.next_slice(ZSTD3, 64 * RAW, opened=False).mode == TRIAL      # 64 MiB at 20 Mbit/s: 12 s
    assert fast.next_slice(ZSTD3, 64 * RAW, opened=False).mode == NONE       # on loopback: 0.3 s
    assert fast.decision == "declined" and fast.figures["open_s"] == deltapick.OPEN_PRIOR_S, fast.figures
    slow.opened(30.0)                                                        # measured: a slow disk
    assert slow.next_slice(ZSTD3, 64 * RAW, opened=False).mode == NONE
    assert slow.next_slice(ZSTD3, 64 * RAW, opened=True).mode == TRIAL      # read already: no cost now


def test_the_push_summary_says_what_the_pick_did():
    from capsule import transfer
    from capsule.cli.transfer import codec_text

    used = transfer.ObjectReport("layer", "x" * 64, "layer", codec="zstd-3", link_rate=2.5 * MB, delta_blocks=6487,
                                 deltas="used")
    assert codec_text(used) == "zstd-3 (link 20.0 Mbit/s), 6487 blocks as deltas"
    declined = transfer.ObjectReport("layer", "x" * 64, "layer", codec="none", deltas="declined")
    assert codec_text(declined) == "none, deltas declined"
    assert codec_text(transfer.ObjectReport("file", "y" * 64, "memory", codec="xz")) == "xz"
