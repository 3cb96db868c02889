"""``python -m diskserver COMMAND``: small tools around a chain spec.

    prefetch SPEC [--visible-only] [--json]   pull every remaining remote block into the shadows
    status SPEC [--json]                      what is still remote, and the last stats a server wrote
    read SPEC OFFSET LENGTH [-o FILE]         read bytes of the flattened disk (fetching as needed)
    serve SPEC SOCKET [--log FILE]            run nbdkit in the foreground until interrupted

Prefetch may run while a server serves the same chain: they share the shadows (a block stored by
one is seen by the other).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from diskserver.chain import Chain, ChainSpec, Progress
from hashcache.errors import Error


def _progress_printer(enabled: bool) -> Progress:
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if enabled and (now - last[0] > 0.5 or done == total):
            last[0] = now
            pct = 100.0 * done / total if total else 100.0
            print(f"\rprefetch {done / 2**20:9.1f} / {total / 2**20:.1f} MiB ({pct:5.1f}%)", end="", file=sys.stderr,
                  flush=True)

    return progress


def cmd_prefetch(args: argparse.Namespace) -> int:
    spec = ChainSpec.load(args.spec)
    t0 = time.monotonic()
    with Chain.open(spec) as chain:
        before = chain.remaining_bytes(args.visible_only)
        blocks = chain.prefetch(progress=_progress_printer(not args.json and sys.stderr.isatty()),
                                visible_only=args.visible_only)
        remaining = chain.remaining_bytes(args.visible_only)
        stats = chain.stats()
    report = {"blocks": blocks, "bytes_before": before, "remaining_bytes": remaining, "complete": remaining == 0,
              "seconds": round(time.monotonic() - t0, 3), "source_bytes": stats["source_bytes"],
              "cache_blocks": stats["cache_blocks"], "wire_bytes": stats["wire_bytes"]}
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(f"\nprefetched {blocks} block(s) in {report['seconds']} s: {stats['source_bytes']} bytes from the "
              f"source, {stats['cache_blocks']} block(s) from the hash cache; remaining {remaining} bytes",
              file=sys.stderr)
    return 0 if remaining == 0 else 1


def cmd_status(args: argparse.Namespace) -> int:
    spec = ChainSpec.load(args.spec)
    with Chain.open(spec, background=False) as chain:
        report = {"size": chain.size, "remaining_bytes": chain.remaining_bytes(),
                  "remaining_visible_bytes": chain.remaining_bytes(visible_only=True),
                  "layers": [{"id": layer.id, "local": layer.local} for layer in chain.layers]}
    try:
        report["server_stats"] = json.loads(spec.resolved_stats_path.read_text())
    except (OSError, ValueError):
        report["server_stats"] = None
    report["complete"] = report["remaining_bytes"] == 0
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(f"size {report['size']} bytes; still remote: {report['remaining_bytes']} bytes "
              f"({report['remaining_visible_bytes']} visible in the chain); complete: {report['complete']}")
    return 0


def cmd_read(args: argparse.Namespace) -> int:
    with Chain.open(args.spec) as chain:
        data = chain.read(args.offset, args.length)
    if args.output:
        with open(args.output, "wb") as f:
            f.write(data)
    else:
        sys.stdout.buffer.write(data)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from diskserver.server import main_serve

    return main_serve(args.spec, args.socket, args.log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diskserver", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prefetch", help="pull every remaining remote block into the shadows")
    p.add_argument("spec")
    p.add_argument("--visible-only", action="store_true", help="only blocks the flattened chain shows")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_prefetch)
    p = sub.add_parser("status", help="what is still remote")
    p.add_argument("spec")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("read", help="read bytes of the flattened disk")
    p.add_argument("spec")
    p.add_argument("offset", type=int)
    p.add_argument("length", type=int)
    p.add_argument("-o", "--output")
    p.set_defaults(func=cmd_read)
    p = sub.add_parser("serve", help="run nbdkit in the foreground")
    p.add_argument("spec")
    p.add_argument("socket")
    p.add_argument("--log")
    p.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s diskserver %(levelname)s %(message)s")
    try:
        code: int = args.func(args)
        return code
    except Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:  # e.g. an offset outside the disk
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
