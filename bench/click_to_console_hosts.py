"""Click to console between the compose hosts (two libvirts: the moves are live), against `capsule migrate` plus
a VNC client at the destination; and the console's latency at the destination after a move.

The desktop image's capsule (1 GiB) runs on compose host A (this bench's own compose project, capsule-cc, agents
on 127.0.0.1:7375 and 7376); A and B know each other as peers. Each run moves it twice, once each way, alternating
which of the two goes first:

- page: Debian's chromium (Playwright), signed in on the capsule's host, its console open on the capsule; the
  Migrate dialog, destination chosen, Live (the default) kept, Migrate clicked. Timed in the page
  (performance.now()) from the click to the **first frame** of the console that followed the capsule to the
  destination (click_to_console.py's WATCH: the first animation frame in which the new canvas holds a drawn
  pixel), noting the dialog saying done and the console saying connected there.
- cli: `capsule migrate NAME --to URL` run on the capsule's host (`docker exec`, a live move: its default), timed
  from its start to its exit, then the VNC client of bench/rfb.py connecting to the destination's console through
  the destination's agent (ticket, WebSocket, RFB handshake) and receiving its first framebuffer update. The
  CLI's own --json progress gives the library's time for the move.

Console latency as bench/console_latency.py measures it (a key typed, alternately `a` and BackSpace, to the
screen changing), on the desktop's terminal: before the first move (the page's console on the capsule's own host,
and a VNC client through that host's agent) and right after it (the page's console that followed the capsule,
relayed through the source's agent to the destination's, and a VNC client through the destination's agent).

    .venv/bin/python bench/click_to_console_hosts.py [--runs 5] [--keys 30] [--keep-hosts]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.click_to_console import WATCH, report, turns  # noqa: E402
from bench.common import temp_workdir  # noqa: E402
from bench.console_latency import through_agent  # noqa: E402
from capsule import capsules, transfer  # noqa: E402
from capsule.store import Store  # noqa: E402
from scripts import composehosts as hc  # noqa: E402
from testkit.chromium import launch  # noqa: E402
from testkit.desktop import AT, CONSOLE_IN_VIEW  # noqa: E402
from testkit.images import IMAGE_HOME, make_store  # noqa: E402
from tests.helpers.dashboard import open_console, sign_in  # noqa: E402

PROJECT = hc.Project("capsule-cc", {"CAPSULE_HOST_A_LISTEN": "127.0.0.1:7375",
                                    "CAPSULE_HOST_B_LISTEN": "127.0.0.1:7376",
                                    "CAPSULE_HOST_IMAGE": "capsule-host:cc", "CAPSULE_S3_PORT": "7377"})
BOOT_TIMEOUT = 600.0


def _focus(page: Any, host: hc.Host, name: str) -> None:
    """The console's keyboard focus, and a click on the desktop's terminal (the guest's X focus)."""
    deadline = time.monotonic() + 60
    while (corner := host.desktop("terminal_top_left", name)) is None:
        if time.monotonic() > deadline:
            raise SystemExit("no terminal on the desktop's screen within 60 s")
        time.sleep(1)
    page.evaluate(CONSOLE_IN_VIEW)
    page.mouse.click(*page.evaluate(AT, [corner[0] + 80, corner[1] + 40]))
    page.wait_for_timeout(500)


def _latency(page: Any, host: hc.Host, name: str, keys: int) -> dict[str, list[float]]:
    """``keys`` samples each of the page's console and a VNC client through ``host``'s agent, taking turns."""
    with through_agent(host, name) as rfb:
        return turns(page, rfb, "agent", keys)


def _page_move(page: Any, name: str, to: str) -> dict[str, float]:
    """On a page signed in on the capsule's host with its console open: migrate it live to the peer ``to`` from
    the dialog; seconds from the click to the dialog saying done, the console connected there, its first frame."""
    from playwright.sync_api import expect

    row = page.locator(f'section[data-host="local"] tr[data-capsule="{name}"]')
    expect(page.locator(f'section[data-host="{to}"]')).to_have_attribute("data-reachable", "yes", timeout=30_000)
    row.locator('button[data-action="migrate"]').click()
    dialog = page.locator("#migrate-dialog")
    page.select_option("#migrate-to", to)
    live = dialog.locator('input[name="kind"][value="live"]')
    expect(live).to_be_enabled(timeout=30_000)
    expect(live).to_be_checked()
    page.evaluate(WATCH, to)
    dialog.locator('[data-action="start-migration"]').click()
    page.wait_for_function("() => window.__cc.frame !== null", timeout=600_000, polling=200)
    w = page.evaluate("window.__cc")
    if page.locator("#migrate-dialog .migrate-message").get_attribute("data-outcome") != "done":
        raise SystemExit("the dialog did not say done")
    dialog.locator('[data-action="close-migration"]').click()
    return {k: round((w[k] - w["click"]) / 1000, 3) for k in ("done", "connected", "frame")}


def _cli_move(src: hc.Host, dst: hc.Host, name: str) -> dict[str, float]:
    """`capsule migrate` on ``src`` to ``dst``, then a VNC client on the console there: seconds from the process's
    start to its exit, to the client's first framebuffer update; the library's own time for the move."""
    t0 = time.monotonic()
    moved = src.capsule("migrate", name, "--to", dst.url, token=dst.token, timeout=900)
    exited = time.monotonic() - t0
    with through_agent(dst, name) as rfb:
        rfb.request(False)
        rfb.update()
        frame = time.monotonic() - t0
    return {"exited": round(exited, 3), "frame": round(frame, 3), "library": round(moved["progress"]["elapsed"], 3),
            "pause_ms": moved["live"]["pause_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs (each moves the capsule once from the page, once "
                                                        "with the CLI)")
    ap.add_argument("--keys", type=int, default=30, help="console latency: keys typed per way, before and after")
    ap.add_argument("--keep-hosts", action="store_true", help="leave the compose project up")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    if why := hc.docker_ready():
        sys.exit(why)
    print("[cc] bringing up the compose hosts (project capsule-cc)", file=sys.stderr)
    PROJECT.compose("down", "--volumes", "--timeout", "5")
    PROJECT.up()
    a, b = PROJECT.host("host-a"), PROJECT.host("host-b")
    name = f"desk{uuid.uuid4().hex[:6]}"
    side = {"a": a, "b": b}
    page_runs: list[dict[str, Any]] = []
    cli_runs: list[dict[str, Any]] = []
    latency: dict[str, dict[str, list[float]]] = {}
    try:
        a.capsule("host", "add", "b", b.url, token=b.token)
        b.capsule("host", "add", "a", a.url, token=a.token)
        with temp_workdir("capsule-bench-") as tmp:
            local = make_store(Path(tmp) / "local", Store.open(IMAGE_HOME), "desktop")
            try:
                capsules.create(local, name, "desktop", memory="1G")
                transfer.push(local, name, a.url, a.token)
            finally:
                local.close()
        a.capsule("start", name, "--timeout", str(int(BOOT_TIMEOUT)), timeout=BOOT_TIMEOUT + 300)
        with sync_playwright() as p:
            browser = launch(p)
            at = "a"                                         # where the capsule runs
            for i in range(args.runs):
                for way in (("page", "cli") if i % 2 == 0 else ("cli", "page")):
                    to = "b" if at == "a" else "a"
                    if way == "page":
                        page = browser.new_page(viewport={"width": 1280, "height": 900})
                        sign_in(page, side[at].url, side[at].token)
                        open_console(page, name, timeout_ms=60_000)
                        page.wait_for_timeout(3000)          # the page sets the guest's size as it opens
                        if not latency:
                            _focus(page, side[at], name)
                            latency["before"] = _latency(page, side[at], name, args.keys)
                        got = _page_move(page, name, to)
                        if "after" not in latency:
                            page.wait_for_timeout(3000)
                            _focus(page, side[to], name)
                            latency["after"] = _latency(page, side[to], name, args.keys)
                        page.close()
                        page_runs.append(got | {"direction": f"{at}->{to}"})
                    else:
                        got = _cli_move(side[at], side[to], name)
                        cli_runs.append(got | {"direction": f"{at}->{to}"})
                    print(f"run {i + 1} {way} {at} → {to}: {got}", flush=True)
                    at = to
            browser.close()
    finally:
        if not args.keep_hosts:
            PROJECT.compose("down", "--volumes", "--timeout", "5")

    report("click_to_console_hosts", "desktop capsule moved live between the compose hosts",
           {"runs": args.runs, "keys": args.keys, "kind": "live (the compose hosts: two libvirts), on loopback"},
           page_runs, cli_runs, latency, {"agent": "VNC client through the capsule's host's agent"})

if __name__ == "__main__":
    main()
