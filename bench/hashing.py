"""Measure hashing throughput on one core: ``.venv/bin/python bench/hashing.py [MiB]``.

Prints MB/s for hash_blocks and scan_blocks on in-memory buffers and for manifest_of_file on a
random file of the given size (default 256 MiB) in the page cache.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hashcache.blocks import hash_blocks, scan_blocks  # noqa: E402
from hashcache.manifest import manifest_of_file  # noqa: E402


def _best(fn: Callable[[], object], nbytes: int, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e6


def main(argv: list[str]) -> None:
    mib = int(argv[0]) if argv else 256
    rnd = os.urandom(8 << 20)
    zero = bytes(8 << 20)
    print(f"hash_blocks  random 8 MiB : {_best(lambda: hash_blocks(rnd), len(rnd)):8.0f} MB/s")
    print(f"scan_blocks  random 8 MiB : {_best(lambda: scan_blocks(rnd), len(rnd)):8.0f} MB/s")
    print(f"scan_blocks  zero   8 MiB : {_best(lambda: scan_blocks(zero), len(zero)):8.0f} MB/s")
    with tempfile.NamedTemporaryFile(prefix="hashcache-bench-") as f:
        for _ in range(mib // 8):
            f.write(os.urandom(8 << 20))
        f.flush()
        size = os.fstat(f.fileno()).st_size
        rate = _best(lambda: manifest_of_file(f.name), size, repeat=3)
        print(f"manifest_of_file random {mib} MiB (page cache): {rate:8.0f} MB/s")


if __name__ == "__main__":
    main(sys.argv[1:])
