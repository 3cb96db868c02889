"""Calendar events: systemd.time(7)'s examples, their normalized forms and next elapses as
``systemd-analyze calendar`` (systemd 252) prints them for a base time of 2026-11-23 11:00:00 UTC."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from capsule.backup.calendar import CalendarError, parse
from capsule.errors import CapsuleError

pytestmark = pytest.mark.unit

BASE = datetime(2026, 11, 23, 11, 0, 0, tzinfo=UTC)   # a Monday

# (event, normalized form, next elapse, the one after; None = never), from systemd-analyze
SYSTEMD = [
    ("Sat,Thu,Mon..Wed,Sat..Sun", "Mon..Thu,Sat,Sun *-*-* 00:00:00", "2026-11-24 00:00:00", "2026-11-25 00:00:00"),
    ("Mon,Sun 12-*-* 2,1:23", "Mon,Sun 2012-*-* 01,02:23:00", None, None),
    ("Wed *-1", "Wed *-*-01 00:00:00", "2027-09-01 00:00:00", "2027-12-01 00:00:00"),
    ("Wed..Wed,Wed *-1", "Wed *-*-01 00:00:00", "2027-09-01 00:00:00", "2027-12-01 00:00:00"),
    ("Wed, 17:48", "Wed *-*-* 17:48:00", "2026-11-25 17:48:00", "2026-12-02 17:48:00"),
    ("Wed..Sat,Tue 12-10-15 1:2:3", "Tue..Sat 2012-10-15 01:02:03", None, None),
    ("*-*-7 0:0:0", "*-*-07 00:00:00", "2026-12-07 00:00:00", "2027-01-07 00:00:00"),
    ("10-15", "*-10-15 00:00:00", "2027-10-15 00:00:00", "2028-10-15 00:00:00"),
    ("monday *-12-* 17:00", "Mon *-12-* 17:00:00", "2026-12-07 17:00:00", "2026-12-14 17:00:00"),
    ("Mon,Fri *-*-3,1,2 *:30:45", "Mon,Fri *-*-01,02,03 *:30:45", "2027-01-01 00:30:45", "2027-01-01 01:30:45"),
    ("12,14,13,12:20,10,30", "*-*-* 12,13,14:10,20,30:00", "2026-11-23 12:10:00", "2026-11-23 12:20:00"),
    ("12..14:10,20,30", "*-*-* 12..14:10,20,30:00", "2026-11-23 12:10:00", "2026-11-23 12:20:00"),
    ("mon,fri *-1/2-1,3 *:30:45", "Mon,Fri *-01/2-01,03 *:30:45", "2027-01-01 00:30:45", "2027-01-01 01:30:45"),
    ("03-05 08:05:40", "*-03-05 08:05:40", "2027-03-05 08:05:40", "2028-03-05 08:05:40"),
    ("08:05:40", "*-*-* 08:05:40", "2026-11-24 08:05:40", "2026-11-25 08:05:40"),
    ("05:40", "*-*-* 05:40:00", "2026-11-24 05:40:00", "2026-11-25 05:40:00"),
    ("Sat,Sun 12-05 08:05:40", "Sat,Sun *-12-05 08:05:40", "2026-12-05 08:05:40", "2027-12-05 08:05:40"),
    ("Sat,Sun 08:05:40", "Sat,Sun *-*-* 08:05:40", "2026-11-28 08:05:40", "2026-11-29 08:05:40"),
    ("2003-03-05 05:40", "2003-03-05 05:40:00", None, None),
    ("2003-02..04-05", "2003-02..04-05 00:00:00", None, None),
    ("2003-03-05 05:40 UTC", "2003-03-05 05:40:00 UTC", None, None),
    ("2003-03-05", "2003-03-05 00:00:00", None, None),
    ("03-05", "*-03-05 00:00:00", "2027-03-05 00:00:00", "2028-03-05 00:00:00"),
    ("minutely", "*-*-* *:*:00", "2026-11-23 11:01:00", "2026-11-23 11:02:00"),
    ("hourly", "*-*-* *:00:00", "2026-11-23 12:00:00", "2026-11-23 13:00:00"),
    ("daily", "*-*-* 00:00:00", "2026-11-24 00:00:00", "2026-11-25 00:00:00"),
    ("daily UTC", "*-*-* 00:00:00 UTC", "2026-11-24 00:00:00", "2026-11-25 00:00:00"),
    ("monthly", "*-*-01 00:00:00", "2026-12-01 00:00:00", "2027-01-01 00:00:00"),
    ("weekly", "Mon *-*-* 00:00:00", "2026-11-30 00:00:00", "2026-12-07 00:00:00"),
    ("yearly", "*-01-01 00:00:00", "2027-01-01 00:00:00", "2028-01-01 00:00:00"),
    ("annually", "*-01-01 00:00:00", "2027-01-01 00:00:00", "2028-01-01 00:00:00"),
    ("quarterly", "*-01,04,07,10-01 00:00:00", "2027-01-01 00:00:00", "2027-04-01 00:00:00"),
    ("semiannually", "*-01,07-01 00:00:00", "2027-01-01 00:00:00", "2027-07-01 00:00:00"),
    ("*:2/3", "*-*-* *:02/3:00", "2026-11-23 11:02:00", "2026-11-23 11:05:00"),
    ("*-02~03", "*-02~03 00:00:00", "2027-02-26 00:00:00", "2028-02-27 00:00:00"),
    ("Mon *-05~07/1", "Mon *-05~07/1 00:00:00", "2027-05-31 00:00:00", "2028-05-29 00:00:00"),
    ("*-*~1", "*-*~01 00:00:00", "2026-11-30 00:00:00", "2026-12-31 00:00:00"),
    ("Mon..Wed", "Mon..Wed *-*-* 00:00:00", "2026-11-24 00:00:00", "2026-11-25 00:00:00"),
    ("Sat..Sun", "Sat,Sun *-*-* 00:00:00", "2026-11-28 00:00:00", "2026-11-29 00:00:00"),
    ("*-*-* 21:00", "*-*-* 21:00:00", "2026-11-23 21:00:00", "2026-11-24 21:00:00"),
    ("*:0/15", "*-*-* *:00/15:00", "2026-11-23 11:15:00", "2026-11-23 11:30:00"),
    ("mon..fri 21:00", "Mon..Fri *-*-* 21:00:00", "2026-11-23 21:00:00", "2026-11-24 21:00:00"),
    ("9..17/2:00", "*-*-* 09..17/2:00:00", "2026-11-23 13:00:00", "2026-11-23 15:00:00"),
    ("*-*-1..7 12:00", "*-*-01..07 12:00:00", "2026-12-01 12:00:00", "2026-12-02 12:00:00"),
    ("*-02-29 00:00", "*-02-29 00:00:00", "2028-02-29 00:00:00", "2032-02-29 00:00:00"),
    ("Mon *-*-* 00:00:00 Europe/Berlin", "Mon *-*-* 00:00:00 Europe/Berlin", "2026-11-29 23:00:00",
     "2026-12-06 23:00:00"),
]


def _utc(s: str | None) -> datetime | None:
    return None if s is None else datetime.fromisoformat(s).replace(tzinfo=UTC)


@pytest.mark.parametrize(("text", "normalized", "first", "second"), SYSTEMD, ids=[r[0] for r in SYSTEMD])
def test_systemd_examples(text, normalized, first, second):
    # systemd-analyze ran with TZ=UTC: give events without a zone the same zone here
    ev = parse(text)
    if ev.zone is None:
        ev = parse(f"{text} UTC")
    assert ev.normalized().removesuffix(" UTC") == normalized.removesuffix(" UTC")
    a = ev.next_after(BASE)
    assert a == _utc(first)
    if a is not None:
        assert ev.next_after(a) == _utc(second)


def test_next_after_is_strictly_after_and_accepts_epoch_seconds():
    ev = parse("*:0/15 UTC")
    at = datetime(2026, 11, 23, 11, 15, tzinfo=UTC)
    assert ev.next_after(at) == datetime(2026, 11, 23, 11, 30, tzinfo=UTC)
    assert ev.next_after(at.timestamp() - 0.5) == at


def test_local_time_is_the_default_and_dst_gaps_are_skipped(monkeypatch):
    # 02:30 does not exist in Berlin on 2027-03-28 (clocks go 02:00 -> 03:00): that day is skipped
    ev = parse("*-*-* 02:30 Europe/Berlin")
    got = ev.next_after(datetime(2027, 3, 27, 12, 0, tzinfo=UTC))
    assert got == datetime(2027, 3, 29, 0, 30, tzinfo=UTC)
    assert parse("daily").zone is None


@pytest.mark.parametrize(("text", "needle"), [
    ("", "empty calendar event"),
    ("sometimes", "'sometimes' is not a weekday"),
    ("Fri..Mon", "runs backwards"),
    ("*-13-01", "month 13"),
    ("*-*-32", "day 32"),
    ("25:00", "hour 25"),
    ("*:60", "minute 60"),
    ("*:*:61", "second 61"),
    ("*:*/15", "not '*/…'"),
    ("*:0/0", "repetition"),
    ("10..5:00", "hour range '10..5' runs backwards"),
    ("12:00:00.5", "fractional seconds"),
    ("daily Mars/Olympus", "unknown time zone 'Mars/Olympus'"),
    ("*-*-* 12:00 13:00", "unexpected '13:00'"),
    ("1-2-3-4", "is not [YEAR-]MONTH-DAY"),
    ("1:2:3:4", "is not HOUR:MINUTE[:SECOND]"),
    ("@1700000000", "not calendar events"),
    ("x" * 300, "too long"),
    ("mon..fri 2a:00", "hour '2a' is not a number"),
])
def test_bad_events_name_the_bad_part(text, needle):
    with pytest.raises(CalendarError, match=None) as info:
        parse(text)
    assert needle in str(info.value)
    assert isinstance(info.value, CapsuleError) and info.value.exit_code == 2
