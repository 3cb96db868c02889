"""The guest agent's request parser under libFuzzer (guest-balloon/fuzz/): the harness builds with
clang's fuzzer, AddressSanitizer and UBSan; the committed corpus and every regression input replay
clean; a short bounded run finds nothing. ``make fuzz`` runs it for longer."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.tools, pytest.mark.timeout(300)]

AGENT_DIR = Path(__file__).resolve().parents[2] / "guest-balloon"
FUZZ_SECONDS = 10


def test_the_request_parser_survives_a_bounded_fuzz_run():
    build = subprocess.run(["make", "-C", str(AGENT_DIR), "fuzz/fuzz_request"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    regressions = sorted((AGENT_DIR / "fuzz" / "regressions").iterdir())
    corpus = sorted((AGENT_DIR / "fuzz" / "corpus").iterdir())
    assert regressions and len(corpus) >= 5
    harness = str(AGENT_DIR / "fuzz" / "fuzz_request")
    replay = subprocess.run([harness, *map(str, corpus + regressions)], capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert f"Executed {regressions[-1]}" in replay.stderr
    run = subprocess.run(["make", "-C", str(AGENT_DIR), "fuzz", f"FUZZ_TIME={FUZZ_SECONDS}"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    execs = int(re.search(r"stat::number_of_executed_units: (\d+)", run.stderr).group(1))
    assert execs > 1000, run.stderr[-2000:]
    assert not list((AGENT_DIR / "fuzz").glob("crash-*"))
