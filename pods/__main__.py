"""``python3 -m pods COMMAND …``: the pod layer's command line in the guest. Prints one JSON object,
``{"ok": true, "result": …}`` or ``{"ok": false, "kind": …, "error": …}``; exit 0 or 3."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pods import FEATURES, VERSION, ckpt, pod
from pods.names import PodError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m pods", description="Pods in this capsule.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("version")
    c = sub.add_parser("create")
    c.add_argument("name")
    c.add_argument("--ip")
    c.add_argument("cmd", nargs=argparse.REMAINDER)
    e = sub.add_parser("exec")
    e.add_argument("name")
    e.add_argument("--timeout", type=float, default=30.0)
    e.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("ls")
    for verb in ("suspend", "resume", "kill", "show"):
        sub.add_parser(verb).add_argument("name")
    k = sub.add_parser("checkpoint")
    k.add_argument("name")
    k.add_argument("--leave-running", action="store_true")
    k.add_argument("--to", metavar="DEVICE", help="write the image onto this block device (a disk the host "
                   "lent) and keep the dump until `drop` or `restore-dump`; answers its size and md5")
    r = sub.add_parser("restore")
    r.add_argument("archive", help="a .pod file, or with --size and --md5 a block device holding one")
    r.add_argument("--size", type=int, help="the image's size in bytes on the device")
    r.add_argument("--md5", help="the image's MD5, checked while it is unpacked")
    sub.add_parser("drop").add_argument("dump")
    sub.add_parser("restore-dump").add_argument("dump")
    return p


def _cmd(args: argparse.Namespace) -> list[str]:
    return args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd


def run(args: argparse.Namespace) -> Any:
    match args.command:
        case "version":
            return {"version": VERSION, "features": list(FEATURES)}
        case "create":
            made = pod.create(args.name, _cmd(args), args.ip)
            ckpt.check_soon()  # the first checkpoint finds criu's verdict ready
            return made
        case "exec":
            return pod.exec_in(args.name, _cmd(args), args.timeout)
        case "ls":
            return pod.all_pods()
        case "show":
            return pod.describe(pod.load(args.name))
        case "suspend" | "resume":
            return pod.set_frozen(args.name, args.command == "suspend")
        case "kill":
            return pod.kill(args.name)
        case "checkpoint":
            return ckpt.checkpoint(args.name, args.leave_running, to=args.to)
        case "restore":
            if (args.size is None) != (args.md5 is None):
                raise PodError("restore from a device takes both --size and --md5", "invalid_name")
            return ckpt.restore(args.archive, size=args.size, md5=args.md5)
        case "drop":
            return ckpt.drop(args.dump)
        case "restore-dump":
            return ckpt.restore_dump(args.dump)
    raise PodError(f"unknown command {args.command}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        out = {"ok": True, "result": run(args)}
    except PodError as exc:
        out = {"ok": False, "kind": exc.kind, "error": str(exc)}
    except OSError as exc:
        out = {"ok": False, "kind": "pod_failed", "error": str(exc)}
    print(json.dumps(out))
    return 0 if out["ok"] else 3


if __name__ == "__main__":
    sys.exit(main())
