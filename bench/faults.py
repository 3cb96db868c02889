"""Fault injection on real transfers, counted (python -m bench.faults [--kills N] [--size MiB]).

Runs each fault kind of testkit/faultkit.py between stores in a temporary directory (real `capsule serve`
agents on loopback speaking TLS, their certificates pinned, the fault proxy of testkit/faultproxy.py, no
guest): link resets and a half-open link mid-push and mid-pull, a push retried through a short reset, a disk
filling up mid-receive (a tmpfs: needs root), SIGKILL of the receiving agent and of `capsule push` at random
points mid-transfer (``--kills`` times each, testkit/faultkills.py: the kill moments are drawn over the span
of a push measured first on this machine; a draw landing after the push ended is drawn again and counted as
missed), slow-loris clients during a push (bench/loris.py);
then, on a tiny guest run by demand paging (testkit/demandfaults.py; ``--no-guest`` leaves it out), SIGKILL
of its disk server at random points of its reads (``--kills`` times) and the link to the source reset and
half-open mid-read.
Writes bench/results/faults.json: per kind the faults injected and survived, the block bytes sent after
them, the bytes that were missing at the receiver, their ratio, and for the kills the draws missed and the
worst excess of one kill's resend over what was missing (against one batch, the batches in flight, and the
manifest a rerun uploads again: its records, 16 bytes per block of the layer).
A kind whose faults injected fall short of those asked is printed as a warning and says why in its detail."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench.common import ROOT, table, temp_workdir, write_result
from bench.loris import slow_loris
from capsule import capsules, images, transfer
from capsule.store import Store
from hashcache.blocks import BLOCK_SIZE
from testkit.faultkills import batch_bytes, kills
from testkit.faultkit import MiB, Outcome, disk_full, link_fault, make_pair, reset_retried


def _scrub(text: str) -> str:
    """An error as the results keep it: without this checkout's or this interpreter's place on disk."""
    return text.replace(sys.executable, "python").replace(str(ROOT), ".")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs of each victim (default 20)")
    ap.add_argument("--size", type=int, default=24, help="MiB of random data in the layer pushed (default 24)")
    ap.add_argument("--no-guest", action="store_true", help="leave out the faults mid-demand-paging (a guest)")
    a = ap.parse_args()
    src = Store.open(Path(os.environ.get("CAPSULE_TEST_IMAGES", ROOT / ".cache" / "test-images")))
    size = a.size * MiB
    outcomes: list[Outcome] = []

    def run(kind: str, fn: Callable[[Path], Outcome]) -> None:
        print(f"-- {kind}", flush=True)
        with temp_workdir("capsule-faults-") as tmp:
            try:
                outcomes.append(fn(Path(tmp)))
            except Exception as exc:  # a fault not survived is a result, not a crash of the benchmark
                traceback.print_exc()
                outcomes.append(Outcome(kind, injected=1, detail=f"{type(exc).__name__}: {exc}"[:500]))

    def pair(tmp: Path) -> tuple[Store, Store]:
        return make_pair(tmp, src, size)

    for direction in ("push", "pull"):
        for fault in ("reset", "half-open"):
            def linked(t: Path, d: str = direction, f: str = fault) -> Outcome:
                return link_fault(*pair(t), d, f)

            run(f"{fault} mid-{direction}", linked)
    run("reset mid-push, retried", lambda t: reset_retried(*pair(t)))

    def full(tmp: Path, layer: int) -> Outcome:
        s = Store.open(tmp / "a")
        images.import_image(src, s, "tiny")
        capsules.create(s, "cap", "tiny", memory="256M")
        from testkit.fleetkit import new_version

        new_version(s, "cap", layer * MiB, 3)
        out = disk_full(s, tmp)
        out.kind = "disk full mid-receive" if layer > 48 else "disk full at install (the layer fits, twice not)"
        return out

    run("disk full mid-receive", lambda t: full(t, 64))
    run("disk full at install", lambda t: full(t, 40))
    for victim in ("agent", "cli"):
        def killed(t: Path, v: str = victim) -> Outcome:
            return kills(*pair(t), v, a.kills, size)

        run(f"SIGKILL {victim} mid-push", killed)
    run("slow-loris during a push", lambda t: slow_loris(*pair(t)))
    if not a.no_guest:
        from testkit import demandfaults

        def mid_demand(tmp: Path) -> Outcome:
            with demandfaults.demand_run(tmp, src, a.kills + 2) as dr:
                for fault in ("reset", "half-open"):
                    outcomes.append(demandfaults.link_fault(dr, fault))
                return demandfaults.server_kills(dr, a.kills)

        run("faults mid-demand-paging", mid_demand)

    rows = [{**asdict(o), "detail": _scrub(o.detail), "ratio": round(o.ratio, 3)} for o in outcomes]
    opts = transfer.Options()
    bound = {"batch_bytes": batch_bytes(), "inflight_bytes": opts.inflight * batch_bytes(),
             "manifest_bytes": size // BLOCK_SIZE * (8 + opts.hash_len),
             "worst_kill_excess": max((o.worst for o in outcomes if o.kind.startswith("SIGKILL") and o.injected),
                                      default=0)}
    short = [o for o in outcomes if o.kind.startswith("SIGKILL") and o.injected < a.kills]
    for o in short:
        print(f"WARNING: {o.kind}: {o.injected} of {a.kills} kills injected: {o.detail}", file=sys.stderr)
    path = write_result("faults", {"layer_mib": a.size, "kills": a.kills, "tls": True, "resend_bound": bound,
                                   "short_of_kills": [o.kind for o in short], "kinds": rows,
                                   "injected": sum(o.injected for o in outcomes),
                                   "survived": sum(o.survived for o in outcomes)})
    table("faults on real transfers (TLS)", ["fault", "injected", "missed", "survived", "bytes resent", "bytes missing",
                                             "ratio", "worst excess"],
          [[o.kind, o.injected, o.missed, o.survived, o.resent, o.missing, f"{o.ratio:.3f}", o.worst]
           for o in outcomes])
    print(path)


if __name__ == "__main__":
    main()
