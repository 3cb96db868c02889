"""systemd calendar events (systemd.time(7), the syntax Proxmox uses for backup jobs): parse one, print
its normalized form, and find when it next elapses.

    [WEEKDAYS] [YEAR-]MONTH-DAY [HOUR:MINUTE[:SECOND]] [TIMEZONE]

Every field takes ``*``, a value, a list (``1,15``), a range (``9..17``) and a repetition (``0/15``:
0, 15, 30, 45; ``9..17/2``: 9, 11 … 17). Weekdays are names (``Mon``, ``monday``) with lists and ranges
(``Mon..Fri``, ``Sat,Sun``). ``~`` counts days from the month's end (``*-02~03``: the third last day
of February; ``Mon *-05~07/1``: the last Monday of May). Missing seconds are 0; a missing time is
00:00:00; a two-digit year is 1970–2069. Shorthands: minutely, hourly, daily, weekly, monthly, yearly
(annually), quarterly, semiannually.

Time zones: an event is evaluated in the host's local time zone, like systemd, unless it ends in
``UTC`` or an IANA zone name (``daily Europe/Berlin``). Wall-clock times that do not exist in the zone
(the hour skipped when clocks go forward) are skipped; in the hour repeated when clocks go back the
first occurrence counts. Fractional seconds and ``*/N`` (systemd refuses it too) are refused.

Not a library because none fits: the Python parsers on the package index either give errors that do
not say which part is wrong, or are marked experimental; this one is small and tested against
systemd's own examples and ``systemd-analyze calendar``."""

from __future__ import annotations

import calendar as _cal
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from capsule.errors import InvalidName

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_LONG_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
SHORTHANDS = {
    "minutely": "*-*-* *:*:00",
    "hourly": "*-*-* *:00:00",
    "daily": "*-*-* 00:00:00",
    "weekly": "Mon *-*-* 00:00:00",
    "monthly": "*-*-01 00:00:00",
    "yearly": "*-01-01 00:00:00",
    "annually": "*-01-01 00:00:00",
    "quarterly": "*-01,04,07,10-01 00:00:00",
    "semiannually": "*-01,07-01 00:00:00",
    "semi-annually": "*-01,07-01 00:00:00",
}
MAX_YEAR = 2199     # systemd stops looking at 2200 too
MAX_LENGTH = 200
_NUMBER = re.compile(r"[0-9]{1,4}")
_ZONE = re.compile(r"[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+)+")


class CalendarError(InvalidName):
    """A calendar event that does not parse; the message names the part that is wrong."""


@dataclass(frozen=True, order=True)
class Item:
    """One list element of a field: ``start``, ``start..stop``, ``start/repeat``, ``start..stop/repeat``."""

    start: int
    stop: int | None = None      # None: a single value, or unbounded when repeat is set
    repeat: int = 0

    def values(self, lo: int, hi: int) -> list[int]:
        if self.repeat:
            last = hi if self.stop is None else min(self.stop, hi)
            return [v for v in range(self.start, last + 1, self.repeat) if v >= lo]
        last = self.start if self.stop is None else self.stop
        return [v for v in range(max(self.start, lo), min(last, hi) + 1)]

    def text(self, width: int) -> str:
        out = f"{self.start:0{width}d}"
        if self.stop is not None:
            out += f"..{self.stop:0{width}d}"
        if self.repeat:
            out += f"/{self.repeat}"
        return out


Field = tuple[Item, ...] | None      # None: '*'


@dataclass(frozen=True)
class CalendarEvent:
    text: str                          # as given
    weekdays: frozenset[int] | None    # 0 = Monday
    year: Field
    month: Field
    day: Field
    end_of_month: bool                 # '~': days count back from the month's last day
    hour: Field
    minute: Field
    second: Field
    zone: str | None                   # None: the host's local time zone

    # -- display ---------------------------------------------------------------------------
    def normalized(self) -> str:
        """The form ``systemd-analyze calendar`` prints as 'Normalized form'."""
        parts = []
        if self.weekdays is not None:
            parts.append(_weekday_text(self.weekdays))
        date = f"{_field_text(self.year, 4)}-{_field_text(self.month, 2)}"
        date += ("~" if self.end_of_month else "-") + _field_text(self.day, 2)
        parts.append(date)
        parts.append(":".join(_field_text(f, 2) for f in (self.hour, self.minute, self.second)))
        if self.zone is not None:
            parts.append(self.zone)
        return " ".join(parts)

    def __str__(self) -> str:
        return self.normalized()

    # -- evaluation ------------------------------------------------------------------------
    def tz(self) -> tzinfo | None:
        return None if self.zone is None else (UTC if self.zone == "UTC" else ZoneInfo(self.zone))

    def next_after(self, when: datetime | float) -> datetime | None:
        """The first time strictly after ``when`` (an aware datetime or epoch seconds) at which the event
        elapses, as an aware datetime in UTC; None if it never elapses again."""
        if isinstance(when, int | float):
            when = datetime.fromtimestamp(when, UTC)
        if when.tzinfo is None:
            raise ValueError("next_after needs an aware datetime (or epoch seconds)")
        zone = self.tz()
        local = when.astimezone(zone) if zone is not None else when.astimezone()
        wall = local.replace(tzinfo=None, microsecond=0) + timedelta(seconds=1)
        for _ in range(100_000):
            found = self._next_wall(wall)
            if found is None:
                return None
            aware = _aware(found, zone)
            if aware is not None and aware > when:
                return aware.astimezone(UTC)
            wall = found + timedelta(seconds=1)
        return None

    def _next_wall(self, t: datetime) -> datetime | None:
        """The first wall-clock time >= ``t`` matching every field (no time zone involved)."""
        while t.year <= MAX_YEAR:
            y = _next_value(self.year, t.year, 1970, MAX_YEAR)
            if y is None:
                return None
            if y != t.year:
                t = datetime(y, 1, 1)
                continue
            m = _next_value(self.month, t.month, 1, 12)
            if m is None:
                t = datetime(t.year + 1, 1, 1)
                continue
            if m != t.month:
                t = datetime(t.year, m, 1)
                continue
            d = self._next_day(t.year, t.month, t.day)
            if d is None:
                t = _first_of_next_month(t)
                continue
            if d != t.day:
                t = datetime(t.year, t.month, d)
                continue
            h = _next_value(self.hour, t.hour, 0, 23)
            if h is None:
                t = datetime(t.year, t.month, t.day) + timedelta(days=1)
                continue
            if h != t.hour:
                t = t.replace(hour=h, minute=0, second=0)
                continue
            mi = _next_value(self.minute, t.minute, 0, 59)
            if mi is None:
                t = t.replace(minute=0, second=0) + timedelta(hours=1)
                continue
            if mi != t.minute:
                t = t.replace(minute=mi, second=0)
                continue
            s = _next_value(self.second, t.second, 0, 59)
            if s is None:
                t = t.replace(second=0) + timedelta(minutes=1)
                continue
            return t.replace(second=s)
        return None

    def _next_day(self, year: int, month: int, day: int) -> int | None:
        last = _cal.monthrange(year, month)[1]
        allowed = self._days(last)
        for d in range(day, last + 1):
            if (allowed is None or d in allowed) and (
                    self.weekdays is None or _cal.weekday(year, month, d) in self.weekdays):
                return d
        return None

    def _days(self, last: int) -> set[int] | None:
        if self.day is None:
            return None
        if not self.end_of_month:
            return {v for item in self.day for v in item.values(1, last)}
        days: set[int] = set()
        for item in self.day:          # ~N is day last+1-N; a repetition runs towards the month's end
            start = last + 1 - item.start
            if item.stop is not None:
                stop = last + 1 - item.stop
                start, stop = min(start, stop), max(start, stop)
            else:
                stop = last if item.repeat else start
            step = item.repeat or 1
            days.update(d for d in range(start, stop + 1, step) if 1 <= d <= last)
        return days


def _aware(wall: datetime, zone: tzinfo | None) -> datetime | None:
    """``wall`` in ``zone`` (None: local), or None if that wall-clock time does not exist there."""
    aware = wall.replace(tzinfo=zone) if zone is not None else wall.astimezone()
    if zone is None:
        back = aware.astimezone().replace(tzinfo=None)
    else:
        back = aware.astimezone(UTC).astimezone(zone).replace(tzinfo=None)
    return aware if back == wall else None


def _first_of_next_month(t: datetime) -> datetime:
    return datetime(t.year + 1, 1, 1) if t.month == 12 else datetime(t.year, t.month + 1, 1)


def _next_value(field: Field, v: int, lo: int, hi: int) -> int | None:
    if field is None:
        return v if v <= hi else None
    best = None
    for item in field:
        for value in item.values(max(v, lo), hi):
            if value >= v and (best is None or value < best):
                best = value
            break
    return best


def _field_text(field: Field, width: int) -> str:
    return "*" if field is None else ",".join(item.text(width) for item in field)


def _weekday_text(days: frozenset[int]) -> str:
    out, run = [], []
    for d in [*range(7), 7]:
        if d < 7 and d in days:
            run.append(d)
            continue
        if len(run) >= 3:
            out.append(f"{WEEKDAYS[run[0]].title()}..{WEEKDAYS[run[-1]].title()}")
        else:
            out.extend(WEEKDAYS[x].title() for x in run)
        run = []
    return ",".join(out)


# -- parsing ---------------------------------------------------------------------------------
def parse(text: str) -> CalendarEvent:
    """Parse a calendar event; a bad one raises ``CalendarError`` naming the part that is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise CalendarError("empty calendar event: give e.g. 'daily', 'mon..fri 21:00' or '*:0/15'")
    if len(text) > MAX_LENGTH or any(ord(c) < 32 for c in text):
        raise CalendarError(f"calendar event {text[:40]!r}…: too long or has control characters")
    words = text.split()
    zone = None
    if len(words) > 1 and (words[-1] == "UTC" or _ZONE.fullmatch(words[-1])):
        zone = _zone(words.pop(), text)
    if len(words) == 1 and words[0].lower() in SHORTHANDS:
        words = SHORTHANDS[words[0].lower()].split()
    weekdays = None
    if words and words[0][:1].isalpha():
        weekdays = _weekdays(words.pop(0).rstrip(","), text)
    date = time = None
    for word in words:
        if word.startswith("@"):
            raise CalendarError(f"{text!r}: '@SECONDS' timestamps are not calendar events")
        if ":" in word and time is None:
            time = word
        elif "-" in word and ":" not in word and date is None and time is None:
            date = word
        else:
            raise CalendarError(f"{text!r}: unexpected {word!r} (expected [WEEKDAYS] [YEAR-]MONTH-DAY "
                                "[HOUR:MINUTE[:SECOND]] [UTC or a zone like Europe/Berlin])")
    if weekdays is None and date is None and time is None:
        raise CalendarError(f"{text!r}: nothing to schedule")
    year = month = day = None
    end_of_month = False
    if date is not None:
        year, month, day, end_of_month = _date(date, text)
    hour = minute = None
    second: Field = (Item(0),)
    if time is not None:
        hour, minute, second = _time(time, text)
    elif date is not None or weekdays is not None:
        hour, minute = (Item(0),), (Item(0),)
    return CalendarEvent(text, weekdays, year, month, day, end_of_month, hour, minute, second, zone)


def _zone(name: str, text: str) -> str:
    if name == "UTC":
        return name
    try:
        if name in available_timezones():
            ZoneInfo(name)
            return name
    except (ZoneInfoNotFoundError, ValueError):
        pass
    raise CalendarError(f"{text!r}: unknown time zone {name!r} (give UTC or an IANA name like Europe/Berlin)")


def _weekday_index(name: str, text: str) -> int:
    low = name.lower()
    for names in (WEEKDAYS, _LONG_WEEKDAYS):
        if low in names:
            return names.index(low)
    raise CalendarError(f"{text!r}: {name!r} is not a weekday (Mon, Tue, Wed, Thu, Fri, Sat, Sun)")


def _weekdays(word: str, text: str) -> frozenset[int]:
    days: set[int] = set()
    for part in word.split(","):
        if not part:
            raise CalendarError(f"{text!r}: empty entry in the weekday list {word!r}")
        a, sep, b = part.partition("..")
        first = _weekday_index(a, text)
        last = _weekday_index(b, text) if sep else first
        if last < first:
            raise CalendarError(f"{text!r}: weekday range {part!r} runs backwards (write it Mon..Sun order, "
                                "or as a list like Fri,Sat,Sun,Mon)")
        days.update(range(first, last + 1))
    return frozenset(days)


def _date(word: str, text: str) -> tuple[Field, Field, Field, bool]:
    end_of_month = "~" in word
    if end_of_month:
        head, _, day_s = word.partition("~")
        parts = [*head.split("-"), day_s]
    else:
        parts = word.split("-")
    if len(parts) == 2:
        parts.insert(0, "*")
    if len(parts) != 3:
        raise CalendarError(f"{text!r}: date {word!r} is not [YEAR-]MONTH-DAY")
    year = _field(parts[0], "year", 1970, MAX_YEAR, text, two_digit_year=True)
    month = _field(parts[1], "month", 1, 12, text)
    day = _field(parts[2], "day", 1, 31, text)
    return year, month, day, end_of_month


def _time(word: str, text: str) -> tuple[Field, Field, Field]:
    parts = word.split(":")
    if len(parts) == 2:
        parts.append("00")
    if len(parts) != 3:
        raise CalendarError(f"{text!r}: time {word!r} is not HOUR:MINUTE[:SECOND]")
    if "." in parts[2].replace("..", ""):
        raise CalendarError(f"{text!r}: fractional seconds in {word!r} are not supported")
    return (_field(parts[0], "hour", 0, 23, text), _field(parts[1], "minute", 0, 59, text),
            _field(parts[2], "second", 0, 59, text))


def _field(s: str, what: str, lo: int, hi: int, text: str, two_digit_year: bool = False) -> Field:
    if s == "*":
        return None
    items = set()
    for part in s.split(","):
        items.add(_item(part, what, lo, hi, text, two_digit_year))
    return tuple(sorted(items))


def _item(part: str, what: str, lo: int, hi: int, text: str, two_digit_year: bool) -> Item:
    body, slash, rep_s = part.partition("/")
    repeat = 0
    if slash:
        if not _NUMBER.fullmatch(rep_s) or int(rep_s) == 0:
            raise CalendarError(f"{text!r}: the repetition in {what} {part!r} must be a whole number above 0")
        repeat = int(rep_s)
    if body == "*":
        raise CalendarError(f"{text!r}: {what} {part!r}: write the start, e.g. '{lo}/{repeat or 1}', not '*/…'")
    a, dots, b = body.partition("..")

    def number(s: str) -> int:
        if not _NUMBER.fullmatch(s):
            raise CalendarError(f"{text!r}: {what} {part!r} is not a number, list, range or repetition")
        v = int(s)
        if two_digit_year and len(s) <= 2:
            v += 2000 if v < 70 else 1900
        if not lo <= v <= hi:
            raise CalendarError(f"{text!r}: {what} {v} in {part!r} is out of range ({lo}..{hi})")
        return v

    start = number(a)
    stop = number(b) if dots else None
    if stop is not None and stop < start:
        raise CalendarError(f"{text!r}: {what} range {part!r} runs backwards")
    return Item(start, stop, repeat)
