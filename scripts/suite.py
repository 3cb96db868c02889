"""The whole test suite as `make test` runs it: three pytest processes at once.

A TCG guest runs on one core, so one pytest booting guests one after another leaves the other core mostly
idle (vmstat over the hosts tier: 55 % idle). The suite runs:

- ``hosts``: every guest-tier file that asks for a session's shared guests: the compose hosts (the `hosts`
  tier, and browser tests on them) and the pod pairs (tests/vm/podpair.py: two pairs of Debian guests);
  a second process would start them a second time;
- ``vm``: every other file of the `vm` and `browser` tiers, about as long;
- ``light``: the `unit` and `tools` tiers, which need little CPU while guests boot.

The two guest processes' lines are printed as they come, each line led by its process's name; the light
tiers' output is printed when all have ended. Each process has its own temporary directory root (two
pytest sessions must not clean up each other's) and prints its 15 slowest tests. All get the same
arguments, after their test folders; the exit status is the worst of the three. A process that failed keeps
its temporary directory (its failed tests' files) and says where. The image store is shared:
its builds take a lock (``testkit.images.ensure_image``).

    python scripts/suite.py [PYTEST_ARGS...]

With arguments that name test paths or a marker expression (`-m`, `-k`), one pytest runs them as given:
that is a selection, not the suite.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
LIGHT = ["tests/unit", "tests/tools"]
GUEST = ["tests/vm", "tests/hosts", "tests/browser"]
COMMON = ["-p", "no:cacheprovider", "--durations=15"]
# session fixtures of shared guests: the compose hosts (tests/helpers/composehosts.py) and the pod pairs
SHARED = frozenset({"hosts", "seeded", "fresh", "pod_pair", "module_pod_pair", "pod_network_pair"})


def fixtures_asked(path: Path) -> set[str]:
    """Every parameter name of the file's functions: the fixtures its tests and its own fixtures ask for."""
    tree = ast.parse(path.read_text())
    return {a.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for a in node.args.args}


def guest_processes() -> dict[str, list[str]]:
    """The two guest processes' arguments: ``-v`` and their test files, each tier's in order."""
    files = [p for folder in GUEST for p in sorted((ROOT / folder).glob("test_*.py"))]
    shared = [p for p in files if fixtures_asked(p) & SHARED]
    return {"vm": ["-v", *(str(p.relative_to(ROOT)) for p in files if p not in shared)],
            "hosts": ["-v", *(str(p.relative_to(ROOT)) for p in shared)]}


def _is_selection(args: list[str]) -> bool:
    return any(a in ("-m", "-k") or a.startswith(("-m=", "-k=")) or not a.startswith("-") and
               (ROOT / a.split("::")[0]).exists() for a in args)


def _free_space(when: str) -> str:
    """How much the temporary directory's disk has free: a full disk fails every tier at once."""
    usage = shutil.disk_usage(tempfile.gettempdir())
    return (f"== {when}: {usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB "
            f"on {tempfile.gettempdir()}")


def _relay(name: str, width: int, stream: IO[str], failures: list[str]) -> None:
    """Print a guest process's lines as they come, each led by the process's name; keep its failures."""
    for line in stream:
        print(f"{name:<{width}} | {line}", end="", flush=True)
        failures.extend(_failures(name, [line]))


def _failures(name: str, lines: Iterable[str]) -> list[str]:
    """The short summary's ``FAILED``/``ERROR`` lines, cut to one line each: on CI pytest prints each failure's
    whole message there, which can push the test's name out of a log's tail."""
    return [f"{name} | {line.rstrip()[:200]}" for line in lines if line.startswith(("FAILED ", "ERROR "))]


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    if _is_selection(args):
        return subprocess.call([*pytest, *args], cwd=ROOT)
    started = time.monotonic()
    print(_free_space("before the suite"), flush=True)
    guests = guest_processes()
    width = max(map(len, guests))
    bases = {name: Path(tempfile.mkdtemp(prefix=f"capsule-{name}-")) for name in ("light", *guests)}
    running: dict[str, subprocess.Popen[str]] = {}
    relays = []
    rcs: dict[str, int] = {}
    failures: list[str] = []
    with tempfile.TemporaryFile("w+", prefix="capsule-light-tiers-") as log:
        try:
            running["light"] = subprocess.Popen([*pytest, *COMMON, f"--basetemp={bases['light']}", *LIGHT, *args],
                                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                                env=os.environ.copy())
            for name, folders in guests.items():
                proc = subprocess.Popen([*pytest, *COMMON, f"--basetemp={bases[name]}", *folders, *args], cwd=ROOT,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=os.environ.copy())
                running[name] = proc
                assert proc.stdout is not None
                relay = threading.Thread(target=_relay, args=(name, width, proc.stdout, failures),
                                         daemon=True)
                relay.start()
                relays.append(relay)
            for name in guests:
                rcs[name] = running[name].wait()
                print(f"\n== {name} ended ({rcs[name]}) after {time.monotonic() - started:.0f} s", flush=True)
            for relay in relays:
                relay.join()
            print(_free_space("after the guest tiers"), flush=True)
            rcs["light"] = running["light"].wait()
        except BaseException:
            for proc in running.values():
                proc.kill()
                proc.wait()
            raise
        finally:
            for name, base in bases.items():     # a failed process's is kept: its failed tests' files are there
                if rcs.get(name, 0) == 0:
                    subprocess.call(["rm", "-rf", str(base)])
                else:
                    print(f"== {name}'s temporary files are kept in {base}", flush=True)
        log.seek(0)
        light = log.read()
        print("\n== the unit and tools tiers (run alongside)\n" + light, flush=True)
        failures.extend(_failures("light", light.splitlines()))
    for failure in failures:
        print(f"== failed: {failure}", flush=True)
    verdict = ", ".join(f"{name} {'passed' if rc == 0 else 'FAILED'}" for name, rc in rcs.items())
    print(f"== the suite: {verdict}, {time.monotonic() - started:.0f} s in all", flush=True)
    return max(rcs.values(), key=lambda rc: rc != 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
