"""Boot to the desktop session, against the Debian guest's boot in the same run.

Each round boots a capsule of the desktop image and one of the debian image (alternately, 1 vCPU, 1 GiB)
with `lifecycle.start(wait=False)` and times, from the start call:

- desktop: the screen showing the session (a screenshot through libvirt, every 0.5 s, mostly the window
  manager's background colour) and its marker ``CAPSULE-DESKTOP-READY`` on the serial console;
- debian: its marker ``CAPSULE-GUEST-READY`` (systemd up, the serial shell about to start).

The ratio desktop/debian (medians) is the cost of the graphical session on this host. Images come from the
test image store (``CAPSULE_TEST_IMAGES``), built there when missing.

    .venv/bin/python bench/desktop_boot.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, table, temp_workdir, write_result  # noqa: E402
from capsule import capsules, images, lifecycle  # noqa: E402
from capsule.console import screen  # noqa: E402
from capsule.errors import Conflict  # noqa: E402
from capsule.imagebuild.desktop import BACKGROUND  # noqa: E402
from capsule.store import Store  # noqa: E402
from capsule.store.catalogue import ImageRow  # noqa: E402
from testkit.images import IMAGE_HOME  # noqa: E402

TIMEOUT = 600.0


def _marker_seen(store: Store, name: str, marker: str) -> bool:
    log = store.instance_dir(name) / "console.log"
    return log.exists() and marker.encode() in log.read_bytes()


def _session_on_screen(store: Store, name: str) -> bool:
    try:
        shot = screen.screenshot(store, name)
    except Conflict:
        return False
    top, n = shot.colours().most_common(1)[0]
    return top == bytes.fromhex(BACKGROUND.lstrip("#")) and n > 0.3 * shot.width * shot.height


def boot(store: Store, image: str, name: str, marker: str, watch_screen: bool) -> dict[str, float]:
    capsules.create(store, name, image, memory="1G")
    t0 = time.monotonic()
    lifecycle.start(store, name, wait=False)
    seen: dict[str, float] = {}
    while len(seen) < (2 if watch_screen else 1):
        if time.monotonic() - t0 > TIMEOUT:
            raise SystemExit(f"{name}: only {sorted(seen)} within {TIMEOUT:.0f} s")
        if "marker" not in seen and _marker_seen(store, name, marker):
            seen["marker"] = time.monotonic() - t0
        if watch_screen and "screen" not in seen and _session_on_screen(store, name):
            seen["screen"] = time.monotonic() - t0
        time.sleep(0.5)
    lifecycle.stop(store, name, force=True)
    return seen


def _image(store: Store, kind: str) -> ImageRow:
    row = store.catalogue.image(kind)
    assert row is not None   # (built, and imported, above)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    images_home = IMAGE_HOME
    src = Store.open(images_home)
    for kind in ("debian", "desktop"):
        images.build(src, kind, kind)
    with temp_workdir("capsule-bench-") as tmp:
        store = Store.open(Path(tmp) / "store")
        for kind in ("debian", "desktop"):
            images.import_image(src, store, kind)
        desktop, debian = _image(store, "desktop"), _image(store, "debian")
        desk_screen, desk_marker, deb_marker = [], [], []
        for r in range(args.rounds):
            d = boot(store, "desktop", f"desk{r}", desktop.marker, watch_screen=True)
            desk_screen.append(d["screen"])
            desk_marker.append(d["marker"])
            deb_marker.append(boot(store, "debian", f"deb{r}", debian.marker, watch_screen=False)["marker"])
        store.close()
    peer = median(deb_marker)
    rows = [[what, f"{median(xs):.1f}", f"{median(xs) / peer:.2f}"] for what, xs in (
        ("desktop: session on screen (screenshot)", desk_screen),
        ("desktop: CAPSULE-DESKTOP-READY", desk_marker),
        ("debian: CAPSULE-GUEST-READY (the peer)", deb_marker))]
    table(f"boot under {args.rounds} rounds (medians)", ["from start to", "seconds", "× debian"], rows)
    info = {k: _image(src, k).info for k in ("debian", "desktop")}
    write_result("desktop_boot", {
        "rounds": args.rounds,
        "desktop_screen_s": desk_screen, "desktop_marker_s": desk_marker, "debian_marker_s": deb_marker,
        "ratio_screen_vs_debian": median(desk_screen) / median(deb_marker),
        "ratio_marker_vs_debian": median(desk_marker) / median(deb_marker),
        "images": {k: {"package_count": v["package_count"], "tree_bytes": v["tree_bytes"],
                       "build_seconds": v["build_seconds"]} for k, v in info.items()},
    })


if __name__ == "__main__":
    main()
