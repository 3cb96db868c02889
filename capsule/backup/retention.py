"""Which snapshots a retention policy keeps, and why (``capsule backup prune``).

The semantics are restic's (``forget --keep-*``, 0.17 and later), which borg (1.2 and later) and Proxmox
share in the parts that matter here:

- every rule looks at all snapshots on its own, newest first; a snapshot kept by several rules lists
  them all;
- ``--keep-last N`` keeps the N newest snapshots;
- ``--keep-hourly/daily/weekly/monthly/yearly N`` keeps the newest snapshot of each of the N newest
  calendar buckets (hour, day, ISO week, month, year) that *have* a snapshot: a period without one
  does not count;
- while such a rule is not yet satisfied (fewer than N buckets), the oldest snapshot is kept as well,
  so the history reaches back as far as it can (restic 0.17; borg 1.2 does the same);
- ``--keep-within DURATION`` (``1y5m7d2h``: years, months, days, hours) keeps every snapshot newer than
  the latest snapshot's time minus DURATION (months and years on the calendar, the day clamped to the
  month's length);
- the latest snapshot is never removed, and an empty policy keeps everything.

Buckets are taken in the time zone given (default: the host's local time, like restic)."""

from __future__ import annotations

import calendar as _cal
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

from capsule.errors import InvalidName

BUCKET_RULES = ("hourly", "daily", "weekly", "monthly", "yearly")
RULES = ("last", *BUCKET_RULES)
MAX_KEEP = 100_000
_DURATION = re.compile(r"(?:(\d{1,4})y)?(?:(\d{1,5})m)?(?:(\d{1,6})d)?(?:(\d{1,7})h)?")


class PolicyError(InvalidName):
    """A retention option that makes no sense (negative count, malformed duration)."""


@dataclass(frozen=True)
class Duration:
    years: int = 0
    months: int = 0
    days: int = 0
    hours: int = 0

    def before(self, t: datetime) -> datetime:
        """``t`` minus this duration, on the calendar (the day clamped to the month's length)."""
        months = t.year * 12 + (t.month - 1) - self.years * 12 - self.months
        y, m = divmod(months, 12)
        try:
            day = min(t.day, _cal.monthrange(y, m + 1)[1])
            return t.replace(year=y, month=m + 1, day=day) - timedelta(days=self.days, hours=self.hours)
        except (ValueError, OverflowError):  # before year 1 (e.g. within=9999y): everything is within
            return t.min.replace(tzinfo=t.tzinfo)

    def __str__(self) -> str:
        return "".join(f"{v}{u}" for v, u in ((self.years, "y"), (self.months, "m"), (self.days, "d"),
                                               (self.hours, "h")) if v)


def parse_duration(text: str) -> Duration:
    m = _DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    if not m or not any(m.groups()) or not any(int(g) for g in m.groups() if g):
        raise PolicyError(f"--keep-within {text!r}: give a duration like 7d, 12h, 1m15d or 1y "
                          "(y years, m months, d days, h hours), above zero")
    return Duration(*(int(g) if g else 0 for g in m.groups()))


@dataclass(frozen=True)
class Policy:
    last: int = 0
    hourly: int = 0
    daily: int = 0
    weekly: int = 0
    monthly: int = 0
    yearly: int = 0
    within: str | None = None

    def __post_init__(self) -> None:
        for rule in RULES:
            n = getattr(self, rule)
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_KEEP:
                raise PolicyError(f"--keep-{rule} {n!r}: give a whole number from 0 to {MAX_KEEP}")
        if self.within is not None:
            parse_duration(self.within)

    @property
    def empty(self) -> bool:
        return self.within is None and not any(getattr(self, r) for r in RULES)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Policy:
        unknown = set(d) - {*RULES, "within"}
        if unknown:
            raise PolicyError(f"unknown retention rule(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    @classmethod
    def parse(cls, text: str) -> Policy:
        """``daily=30,weekly=12,within=1y`` (the --keep-* rules without their prefix)."""
        d: dict[str, Any] = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            rule, sep, value = part.partition("=")
            rule = rule.strip().removeprefix("keep-")
            if not sep or rule not in (*RULES, "within"):
                raise PolicyError(f"{part!r}: give rules like daily=30,weekly=12,within=1y "
                                  f"(rules: {', '.join((*RULES, 'within'))})")
            if rule == "within":
                d[rule] = value.strip()
            elif not value.strip().isascii() or not value.strip().isdigit():
                raise PolicyError(f"{part!r}: {rule} takes a whole number")
            elif len(value.strip()) > len(str(MAX_KEEP)):  # int() refuses more than 4300 digits
                raise PolicyError(f"{part!r}: give a whole number from 0 to {MAX_KEEP}")
            else:
                d[rule] = int(value)
        if not d:
            raise PolicyError("an empty policy: give rules like daily=30,weekly=12,within=1y")
        return cls.from_dict(d)

    def describe(self) -> str:
        parts = [f"keep-{r} {getattr(self, r)}" for r in RULES if getattr(self, r)]
        if self.within:
            parts.append(f"keep-within {self.within}")
        return ", ".join(parts) or "keep everything"


@dataclass(frozen=True)
class Snapshot:
    number: int        # the version number
    time: float        # epoch seconds


@dataclass
class Decision:
    snapshot: Snapshot
    keep: bool
    reasons: list[str] = field(default_factory=list)   # e.g. ["last", "daily"], "daily (oldest)", "latest"

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.snapshot.number, "time": self.snapshot.time, "keep": self.keep,
                "reasons": list(self.reasons)}


def bucket(rule: str, t: datetime) -> tuple[int, ...]:
    if rule == "hourly":
        return (t.year, t.month, t.day, t.hour)
    if rule == "daily":
        return (t.year, t.month, t.day)
    if rule == "weekly":
        iso = t.isocalendar()
        return (iso.year, iso.week)
    if rule == "monthly":
        return (t.year, t.month)
    if rule == "yearly":
        return (t.year,)
    raise ValueError(rule)


def _local(t: float, tz: tzinfo | None) -> datetime:
    return datetime.fromtimestamp(t, UTC).astimezone(tz) if tz is not None else datetime.fromtimestamp(t).astimezone()


def apply(snapshots: Iterable[Snapshot], policy: Policy, tz: tzinfo | None = None) -> list[Decision]:
    """A decision for every snapshot, newest first."""
    ordered = sorted(snapshots, key=lambda s: (s.time, s.number), reverse=True)
    if not ordered:
        return []
    if policy.empty:
        return [Decision(s, True, ["no policy"]) for s in ordered]
    left = {r: getattr(policy, r) for r in RULES}
    last: dict[str, tuple[int, ...] | None] = dict.fromkeys(RULES)
    cutoff = None
    if policy.within:
        cutoff = parse_duration(policy.within).before(_local(ordered[0].time, tz)).timestamp()
    out = []
    for i, snap in enumerate(ordered):
        reasons = []
        oldest = i == len(ordered) - 1
        if cutoff is not None and snap.time > cutoff:
            reasons.append(f"within {policy.within}")
        t = _local(snap.time, tz)
        for rule in RULES:
            if left[rule] <= 0:
                continue
            key = (i,) if rule == "last" else bucket(rule, t)
            if key != last[rule]:
                reasons.append(rule)
            elif oldest:
                reasons.append(f"{rule} (oldest)")    # the rule is not satisfied yet: keep the oldest too
            else:
                continue
            last[rule] = key
            left[rule] -= 1
        if i == 0 and not reasons:
            reasons.append("latest")
        out.append(Decision(snap, bool(reasons), reasons))
    return out
