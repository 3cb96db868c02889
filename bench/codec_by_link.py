"""The codec picked by the link (issue 28): bytes and seconds of a push of one new layer (half text-like,
half random) over a shaped link (testkit/netlink.py SlowLink, 20 ms RTT), with the codec picked by the
link ("auto"), zstd -3 frames (the default before) and ``--xz``. Needs root (network namespaces).

    .venv/bin/python bench/codec_by_link.py --mib 64 --kbit 20000 --out bench/results/codec_by_link.json

``--out`` adds this run's rows to that JSON file (rows of the same size, rate, codec and run number are
replaced); ``--runs N`` pushes N times with each codec, in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capsule import capsules, images  # noqa: E402
from capsule.store import Store  # noqa: E402
from testkit.fleetkit import new_version  # noqa: E402
from testkit.images import image_store  # noqa: E402
from testkit.netlink import SlowLink  # noqa: E402
from testkit.payloads import text  # noqa: E402

PUSH = """
import json, sys
from pathlib import Path
from capsule import transfer
from capsule.store import Store
from hashcache.transport.http import HttpTransport
home, url, token, pin, how = sys.argv[1:6]
opts = {"auto": transfer.Options(), "zstd-3": transfer.Options(level=3), "xz": transfer.Options(xz=True)}[how]
r = transfer.push(Store.open(Path(home)), "cap", url, token, opts, transport=HttpTransport(url, token, fingerprint=pin))
print(json.dumps({"how": how, "wire_bytes": r.wire_bytes, "seconds": round(r.seconds, 1),
                  "codecs": [o.codecs for o in r.objects]}))
"""


def save(path: Path, row: dict) -> None:
    """Add ``row`` to the rows in ``path``, in place of one of the same size, rate and codec."""
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    key = ("mib", "kbit", "how", "run")
    rows = [r for r in rows if tuple(r[k] for k in key) != tuple(row[k] for k in key)] + [row]
    rows.sort(key=lambda r: (-r["kbit"], r["mib"], r["run"], r["how"]))
    path.write_text(json.dumps({"bench": "codec_by_link", "cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--kbit", type=int, default=20_000)
    ap.add_argument("--how", default="auto,zstd-3,xz")
    ap.add_argument("--out", type=Path, help="add the rows to this JSON file")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    size = args.mib << 20
    content = bytearray()
    for k in range(0, size, 1 << 20):   # text and random MiB by MiB
        content += text(1 << 20, k) if (k >> 20) % 2 == 0 else random.Random(k).randbytes(1 << 20)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        a = Store.open(work / "a")
        images.import_image(image_store(), a, "tiny")
        capsules.create(a, "cap", "tiny", memory="256M")
        new_version(a, "cap", size, seed=0, content=bytes(content))
        a.close()
        for run, how in [(r, h) for r in range(1, args.runs + 1) for h in args.how.split(",")]:
            b = Store.open(work / f"{how}-{run}")
            images.import_image(image_store(), b, "tiny")
            b.close()
            token_file = work / f"{how}-{run}.token"
            with SlowLink(rate_kbit=args.kbit, rtt_ms=20) as link:
                url, pin = link.agent_b(work / f"{how}-{run}", token_file)
                out = link.exec_a([sys.executable, "-c", PUSH, str(work / "a"), url, token_file.read_text().strip(),
                                   pin, how], capture_output=True, text=True, cwd=ROOT,
                                  env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            row = {"mib": args.mib, "kbit": args.kbit, "run": run, **json.loads(out.stdout.strip().splitlines()[-1])}
            print(json.dumps(row), flush=True)
            if args.out:
                save(args.out, row)


if __name__ == "__main__":
    main()
