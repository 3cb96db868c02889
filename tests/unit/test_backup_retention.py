"""Retention: restic's semantics pinned by examples, and a property test against a small reference
model written another way (group into buckets first, then take the newest N)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsule.backup.retention import BUCKET_RULES, Policy, PolicyError, Snapshot, apply, bucket, parse_duration

pytestmark = pytest.mark.unit


def at(s: str) -> float:
    return datetime.fromisoformat(s).replace(tzinfo=UTC).timestamp()


def kept(snaps, policy) -> dict[int, list[str]]:
    return {d.snapshot.number: d.reasons for d in apply(snaps, policy, UTC) if d.keep}


def test_forum_example_keep_daily_4():
    # restic forum "keep vs keep-within": a1 May 1 8:00, a2 May 2 8:00, a3 May 2 11:00, a4 May 4, a5 May 5
    snaps = [Snapshot(1, at("2026-05-01 08:00")), Snapshot(2, at("2026-05-02 08:00")),
             Snapshot(3, at("2026-05-02 11:00")), Snapshot(4, at("2026-05-04 09:00")),
             Snapshot(5, at("2026-05-05 10:00"))]
    # the empty May 3 does not count: a5, a4, a3 (latest of May 2), a1
    assert sorted(kept(snaps, Policy(daily=4))) == [1, 3, 4, 5]


def test_rule_not_satisfied_keeps_the_oldest():
    snaps = [Snapshot(1, at("2026-05-02 08:00")), Snapshot(2, at("2026-05-02 09:00")),
             Snapshot(3, at("2026-05-02 10:00"))]
    # one day only, keep-daily 7 not reached: the newest of the day, and the oldest as well
    assert kept(snaps, Policy(daily=7)) == {3: ["daily"], 1: ["daily (oldest)"]}
    # reached exactly: no extra
    assert kept(snaps, Policy(daily=1)) == {3: ["daily"]}


def test_iso_weeks():
    # Sun 2027-01-03 is in ISO week 2026-W53; Mon 2027-01-04 starts 2027-W01
    snaps = [Snapshot(1, at("2026-12-31 12:00")), Snapshot(2, at("2027-01-03 12:00")),
             Snapshot(3, at("2027-01-04 12:00"))]
    assert bucket("weekly", datetime(2027, 1, 3)) == (2026, 53)
    assert sorted(kept(snaps, Policy(weekly=2))) == [2, 3]


def test_several_rules_name_every_reason_and_latest_is_never_removed():
    snaps = [Snapshot(n, at("2026-01-01 00:00") + n * 3600 * 7) for n in range(1, 30)]
    assert 1 not in kept(snaps, Policy(last=2, daily=3, monthly=1))   # one month, one asked: satisfied
    k = kept(snaps, Policy(last=2, daily=3, monthly=2))
    assert k[29] == ["last", "daily", "monthly"]
    assert k[28] == ["last"]
    assert len(k) == 4 + 1   # 2 last + 2 more days + the oldest (keep-monthly 2 not reached: one month)
    assert k[1] == ["monthly (oldest)"]
    only_within = kept(snaps, Policy(within="1d"))
    assert 29 in only_within and all(r == ["within 1d"] for r in only_within.values())


def test_keep_within_uses_calendar_months():
    snaps = [Snapshot(1, at("2026-02-27 12:00")), Snapshot(2, at("2026-02-28 13:00")),
             Snapshot(3, at("2026-03-31 12:00"))]
    # one month before Mar 31 12:00 is Feb 28 12:00 (clamped): Feb 28 13:00 is newer, Feb 27 is not
    assert sorted(kept(snaps, Policy(within="1m"))) == [2, 3]


def test_empty_policy_keeps_everything_and_no_snapshots_is_fine():
    snaps = [Snapshot(1, 1.0), Snapshot(2, 2.0)]
    assert all(d.keep and d.reasons == ["no policy"] for d in apply(snaps, Policy(), UTC))
    assert apply([], Policy(last=1), UTC) == []


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"daily": -1}, "--keep-daily -1"), ({"last": 1.5}, "--keep-last 1.5"), ({"within": "3 weeks"}, "duration"),
    ({"within": "0d"}, "above zero"), ({"within": ""}, "duration"),
])
def test_bad_policies(kwargs, needle):
    with pytest.raises(PolicyError) as info:
        Policy(**kwargs)
    assert needle in str(info.value)


def test_durations():
    assert parse_duration("1y5m7d2h").__dict__ == {"years": 1, "months": 5, "days": 7, "hours": 2}
    assert str(parse_duration("36h")) == "36h"


# -- the reference model -------------------------------------------------------------------------
def reference(snaps: list[Snapshot], policy: Policy) -> dict[int, set[str]]:
    """Per kept snapshot, the set of rules that keep it (without the '(oldest)' note)."""
    newest_first = sorted(snaps, key=lambda s: (s.time, s.number), reverse=True)
    out: dict[int, set[str]] = {}
    if not newest_first:
        return out
    if policy.empty:
        return {s.number: {"no policy"} for s in snaps}
    for s in newest_first[:policy.last]:
        out.setdefault(s.number, set()).add("last")
    if policy.last > len(newest_first):
        pass  # every snapshot is already kept by keep-last
    for rule in BUCKET_RULES:
        n = getattr(policy, rule)
        if not n:
            continue
        groups: dict[tuple[int, ...], list[Snapshot]] = {}
        for s in newest_first:
            groups.setdefault(bucket(rule, datetime.fromtimestamp(s.time, UTC)), []).append(s)
        keys = sorted(groups, reverse=True)
        for key in keys[:n]:
            out.setdefault(groups[key][0].number, set()).add(rule)
        if len(keys) < n:
            out.setdefault(newest_first[-1].number, set()).add(rule)
    if policy.within:
        limit = parse_duration(policy.within).before(datetime.fromtimestamp(newest_first[0].time, UTC))
        for s in newest_first:
            if s.time > limit.timestamp():
                out.setdefault(s.number, set()).add(f"within {policy.within}")
    out.setdefault(newest_first[0].number, {"latest"})
    return out


START = datetime(2024, 12, 20, tzinfo=UTC).timestamp()
snapshot_lists = st.lists(st.integers(min_value=0, max_value=int(3 * 365 * 86400)), max_size=40, unique=True).map(
    lambda offsets: [Snapshot(i + 1, START + off) for i, off in enumerate(sorted(offsets))])
policies = st.builds(Policy, last=st.integers(0, 5), hourly=st.integers(0, 5), daily=st.integers(0, 8),
                     weekly=st.integers(0, 6), monthly=st.integers(0, 6), yearly=st.integers(0, 3),
                     within=st.one_of(st.none(), st.sampled_from(["1h", "2d", "1m", "3m10d", "1y"])))


@settings(max_examples=400, deadline=None)
@given(snapshot_lists, policies)
def test_matches_the_reference_model(snaps, policy):
    decisions = apply(snaps, policy, UTC)
    got = {d.snapshot.number: {r.removesuffix(" (oldest)") for r in d.reasons} for d in decisions if d.keep}
    assert got == reference(snaps, policy)
    assert len(decisions) == len(snaps)
    if snaps:
        assert decisions[0].keep                           # the latest is never removed
        assert all(d.reasons for d in decisions if d.keep)  # every kept snapshot says why
        assert not any(d.reasons for d in decisions if not d.keep)


@settings(max_examples=100, deadline=None)
@given(snapshot_lists, st.integers(1, 6))
def test_more_buckets_never_keep_fewer(snaps, n):
    for rule in BUCKET_RULES:
        fewer = {k for k, _ in kept(snaps, Policy(**{rule: n})).items()}
        more = {k for k, _ in kept(snaps, Policy(**{rule: n + 1})).items()}
        assert len(more) >= len(fewer)
        # the buckets counted are the ones with a snapshot: a gap does not use up a count
        days = {bucket(rule, datetime.fromtimestamp(s.time, UTC)) for s in snaps}
        assert len(fewer - {min((s.number for s in snaps), default=None)}) <= min(n, len(days))

