"""Build (and optionally test-boot) a guest image by hand.

python -m capsule.imagebuild tiny /tmp/img/tiny --boot
python -m capsule.imagebuild debian /tmp/img/debian --disk-size 3G --extra vim-tiny --boot
python -m capsule.imagebuild desktop /tmp/img/desktop --boot

--boot also pings the guest agent over its virtio-serial port.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from . import ImageBuildError, build_debian, build_desktop, build_tiny
from .qemuboot import GuestError, SerialGuest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m capsule.imagebuild", description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("tiny", "debian", "desktop"))
    ap.add_argument("workdir", type=Path, help="fresh directory for the outputs")
    ap.add_argument("--disk-size", default="2G", help="debian: size of the raw root disk")
    ap.add_argument("--extra", action="append", default=[], help="debian: extra package (repeatable)")
    ap.add_argument("--boot", action="store_true", help="boot the result with QEMU (TCG) to the marker")
    ap.add_argument("--boot-timeout", type=float, default=180.0)
    args = ap.parse_args(argv)

    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    try:
        if args.kind == "tiny":
            img = build_tiny(args.workdir, progress)
        elif args.kind == "desktop":
            img = build_desktop(args.workdir, progress, disk_size=args.disk_size)
        else:
            img = build_debian(args.workdir, progress, disk_size=args.disk_size, extra_packages=args.extra)
    except ImageBuildError as exc:
        print(f"image build failed: {exc}", file=sys.stderr)
        return 1
    result = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(img).items()}
    if args.boot:
        progress("booting with qemu -accel tcg")
        try:
            # the desktop needs a screen (a standard VGA card, as a capsule's) and room for X
            screen = {"memory_mb": 1024, "extra_args": ["-vga", "std"]} if args.kind == "desktop" else {}
            with SerialGuest.boot(img, snapshot=True, log_path=args.workdir / "boot-console.log", **screen) as guest:
                result["boot_seconds_to_marker"] = round(guest.wait_for_marker(img.marker, args.boot_timeout), 2)
                result["boot_seconds_to_shell"] = round(guest.wait_for_shell(60), 2)
                result["guest_uname"] = guest.run("uname -a")
                reply = guest.agent_call("ping", timeout=60)
                if not reply.get("ok"):
                    raise GuestError(f"the guest agent answered ping with {reply}")
                result["boot_seconds_to_agent"] = round(time.monotonic() - guest.started, 2)
                result["agent_ping"] = reply["result"]
        except GuestError as exc:
            print(f"boot test failed: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
