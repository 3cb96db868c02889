"""A commute's memory through the live move's memory codec: held pages as hashes against runs of blocks.

A running tiny guest fills some memory (random data in tmpfs, a copy of disk blocks) and a version is taken
with its memory image: yesterday's, which the destination holds. The guest then changes a little (``--change``
MiB of new random data) and a second version is taken (the move's T0: its layers and boot files are what both
hosts hold, with yesterday's memory image). QEMU's migration stream of the running guest is then read here and
encoded three ways in the same run (``capsule/migrate/ramdedup.py``):

- ``zstd``: no references, every page compressed (what a peer that knows nothing of the destination sends);
- ``hashes``: pages the destination holds as a 33-byte hash each after their raw 8-byte header (before runs);
- ``runs``: the same pages as runs of blocks by place (OP_BLOCKS), decoded again here against the store and
  checked byte for byte against QEMU's stream.

    .venv/bin/python bench/memory_runs.py [--memory 256M] [--fill 64] [--change 4] [--kbit 384]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table, temp_workdir, tiny_stores, write_result  # noqa: E402
from capsule import capsules, lifecycle  # noqa: E402
from capsule.migrate import memrefs  # noqa: E402
from capsule.migrate.ramdedup import Decoder, Encoder, Known  # noqa: E402
from capsule.runtime.connection import lookup_domain  # noqa: E402
from testkit import qemustream  # noqa: E402
from tests.helpers.guest import run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", default="256M", help="the guest's memory (default 256M)")
    ap.add_argument("--fill", type=int, default=64, help="MiB of random data in tmpfs before yesterday (64)")
    ap.add_argument("--change", type=int, default=4, help="MiB of new random data since yesterday (4)")
    ap.add_argument("--kbit", type=int, default=384, help="the link the seconds are given for (384 kbit/s)")
    args = ap.parse_args()
    with temp_workdir("capsule-bench-") as tmp:
        [store] = tiny_stores(Path(tmp) / "store")
        capsules.create(store, "m", "tiny", memory=args.memory)
        lifecycle.start(store, "m")
        run(store, "m", f"head -c {args.fill << 20} /dev/urandom > /dev/shm/day; head -c 8388608 /dev/vda > "
                        "/dev/shm/disk; sync", timeout=300)
        yesterday = lifecycle.snapshot(store, "m")[0].version
        run(store, "m", f"head -c {args.change << 20} /dev/urandom > /dev/shm/today", timeout=300)
        t0 = lifecycle.snapshot(store, "m")[0].version
        assert yesterday is not None and t0 is not None and yesterday.memory
        objects = memrefs.shared_objects(store, t0, {yesterday.memory})
        t = time.perf_counter()
        known = memrefs.known_of(store, objects)
        known_s = time.perf_counter() - t
        resolver = memrefs.StoreResolver(store, objects)
        zstd, hashes, runs = Encoder(Known()), Encoder(known), Encoder(known, runs=True)
        decoder = Decoder(resolver)
        qemu, rebuilt = hashlib.sha256(), hashlib.sha256()
        cpu = {"hashes": 0.0, "runs": 0.0}

        def sink(chunk: bytes) -> None:
            qemu.update(chunk)
            zstd.encode(chunk)
            c = time.perf_counter()
            hashes.encode(chunk)
            cpu["hashes"] += time.perf_counter() - c
            c = time.perf_counter()
            frames = runs.encode(chunk)
            cpu["runs"] += time.perf_counter() - c
            rebuilt.update(decoder.decode(frames))

        qemustream.stream_out(lookup_domain(store.domain_name("m")), Path(store.catalogue.instance("m").dir), sink)
        zstd.finish()
        hashes.finish()
        rebuilt.update(decoder.decode(runs.finish()))
        decoder.finish()
        resolver.close()
        lifecycle.stop(store, "m", force=True, timeout=5)
        assert rebuilt.digest() == qemu.digest(), "the stream rebuilt from runs differs from QEMU's"

    rate = args.kbit * 1000 / 8
    rows, figures = [], {}
    for name, enc in (("zstd", zstd), ("hashes", hashes), ("runs", runs)):
        s = enc.stats
        figures[name] = {"wire_bytes": s.wire_bytes, "refs": s.refs, "runs": s.runs, "recent": s.recent,
                         "raw_pages": s.raw_pages, "seconds_at_link": round(s.wire_bytes / rate, 1),
                         **({"encode_cpu_s": round(cpu[name], 2)} if name in cpu else {})}
        rows.append([name, f"{s.wire_bytes / 1e6:.2f}", s.refs, s.runs, s.raw_pages, f"{s.wire_bytes / rate:.1f}"])
    stream = zstd.stats.stream_bytes
    table(f"a commute's memory ({args.memory}, {args.change} MiB changed), QEMU's stream {stream / 1e6:.1f} MB",
          ["codec", "MB", "held pages", "runs", "literal pages", f"s at {args.kbit} kbit/s"], rows)
    ratio = runs.stats.wire_bytes / hashes.stats.wire_bytes
    print(f"runs / hashes: {ratio:.3f}; Known built in {known_s:.2f} s for {len(known)} blocks")
    write_result("memory_runs", {"memory": args.memory, "fill_mib": args.fill, "change_mib": args.change,
                                 "kbit": args.kbit, "stream_bytes": stream, "known_blocks": len(known),
                                 "known_build_s": round(known_s, 2), "cases": figures,
                                 "runs_vs_hashes": round(ratio, 3), "intact": True})


if __name__ == "__main__":
    main()
