"""The whole test suite as `make test` runs it: the light tiers alongside the guest tiers.

The `unit` and `tools` tiers (tests/unit/, tests/tools/) need little CPU while guests boot, and the `vm`,
`hosts` and `browser` tiers spend most of their time waiting on TCG guests, so the two run as two pytest
processes at once: the guest tiers in the foreground (their output as it comes), the light tiers in the
background into a log that is printed when both have ended. Both get the same arguments, after the tier
folders; the exit status is the worse of the two.

    python scripts/suite.py [PYTEST_ARGS...]

With arguments that name test paths or a marker expression (`-m`, `-k`), one pytest runs them as given:
that is a selection, not the suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIGHT = ["tests/unit", "tests/tools"]
GUEST = ["tests/vm", "tests/hosts", "tests/browser"]
COMMON = ["-p", "no:cacheprovider", "--durations=15"]


def _is_selection(args: list[str]) -> bool:
    return any(a in ("-m", "-k") or a.startswith(("-m=", "-k=")) or not a.startswith("-") and
               (ROOT / a.split("::")[0]).exists() for a in args)


def _free_space(when: str) -> str:
    """How much the temporary directory's disk has free: a full disk fails every tier at once."""
    usage = shutil.disk_usage(tempfile.gettempdir())
    return (f"== {when}: {usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB "
            f"on {tempfile.gettempdir()}")


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    if _is_selection(args):
        return subprocess.call([*pytest, *args], cwd=ROOT)
    started = time.monotonic()
    print(_free_space("before the suite"), flush=True)
    with tempfile.TemporaryFile("w+", prefix="capsule-light-tiers-") as log:
        # its own temporary directory root: two pytest sessions must not clean up each other's
        base = Path(tempfile.mkdtemp(prefix="capsule-light-tiers-"))
        light = subprocess.Popen([*pytest, *COMMON, f"--basetemp={base}", *LIGHT, *args], cwd=ROOT,
                                 stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            guest = subprocess.call([*pytest, *COMMON, *GUEST, *args], cwd=ROOT)
            print(f"\n== the guest tiers ended ({guest}) after {time.monotonic() - started:.0f} s; "
                  "waiting for the unit and tools tiers", flush=True)
            print(_free_space("after the guest tiers"), flush=True)
            light_rc = light.wait()
        except BaseException:
            light.kill()
            light.wait()
            raise
        log.seek(0)
        print("\n== the unit and tools tiers (run alongside)\n" + log.read(), flush=True)
        subprocess.call(["rm", "-rf", str(base)])
    print(f"== the suite: guest tiers {'passed' if guest == 0 else 'FAILED'}, unit and tools tiers "
          f"{'passed' if light_rc == 0 else 'FAILED'}, {time.monotonic() - started:.0f} s in all", flush=True)
    return guest or light_rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
