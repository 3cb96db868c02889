"""The calendar parser against the real ``systemd-analyze calendar`` on this host: the same normalized
form and the same next elapses, from several base times (month ends, leap days, year ends)."""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import UTC, datetime

import pytest

from capsule.backup.calendar import parse
from tests.unit.test_backup_calendar import SYSTEMD

pytestmark = [pytest.mark.tools, pytest.mark.timeout(120)]

BASES = ["2026-11-23 11:00:00", "2027-02-28 23:59:59", "2028-02-28 12:00:00", "2026-12-31 23:45:00"]
EXTRA = ["Mon..Fri *-*-* 21:00", "*-*-* *:0/10", "Sat *-*~07/1 03:00", "*-1..3,10-1/7 6:30", "Sun 2027..2030-*-*"]


def _systemd(event: str, base: str) -> tuple[str, list[datetime]]:
    out = subprocess.run(["systemd-analyze", "calendar", f"--base-time={base} UTC", "--iterations=3", event],
                         capture_output=True, text=True, timeout=30, env={"TZ": "UTC", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    normalized = re.search(r"Normalized form: (.*)", out.stdout).group(1).strip()
    times = [datetime.strptime(m, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
             for m in re.findall(r"(?:Next elapse|Iteration #\d+): \w+ (\S+ \S+) UTC", out.stdout)]
    return normalized, times


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("event", [row[0] for row in SYSTEMD if parse(row[0]).zone is None] + EXTRA)
def test_same_as_systemd_analyze(event):
    for base in BASES:
        normalized, times = _systemd(f"{event} UTC", base)
        ev = parse(f"{event} UTC")
        assert ev.normalized() == normalized
        got, at = [], datetime.fromisoformat(base).replace(tzinfo=UTC)
        for _ in times:
            at = ev.next_after(at)
            if at is None:
                break
            got.append(at)
        assert got == times, (event, base)
