"""Click to console: from Migrate in the dashboard to the guest's screen at the destination, against `capsule
migrate` plus a VNC client there; and the console's latency at the destination after a move.

Two stores holding the desktop image and two agents (`capsule serve`) on this machine, on loopback, each knowing
the other as a peer ("a", "b"); no compose hosts are needed. The desktop capsule (1 GiB) runs a maximised xterm
with a shell. Each run moves it twice, once each way, alternating which of the two goes first:

- page: Debian's chromium (Playwright), signed in on the capsule's host, its console open on the capsule; the
  Migrate dialog, destination chosen, Migrate clicked. Timed in the page (performance.now()) from the click
  (a capture listener on the button) to the **first frame**: the first animation frame in which the canvas of
  the console that followed the capsule (the noVNC connection the page opened to the destination, through
  this host's agent; #console data-peer the destination) holds a drawn pixel. noVNC's canvas is transparent
  until it draws a framebuffer update, and the first update after connecting is the whole screen, so this is
  the moment the destination's screen is first shown. Also noted: the dialog saying done, and the console
  saying connected.
- cli: the `capsule migrate NAME --to PEER --offline` process, timed from its start, then, when it exits, the
  VNC client of bench/rfb.py connecting to the destination's console through its agent (a console ticket,
  the console WebSocket, the RFB handshake) and receiving its first framebuffer update (a full one).

Both moves are the same kind: on one machine both agents share one libvirtd, so the pre-check refuses a live
move (the dialog greys Live out and falls back to Offline: full), and the CLI is told --offline (full too).
The CLI's own --json progress gives the library's time for the move.

Console latency as bench/console_latency.py measures it (a key typed, alternately `a` and BackSpace, to the
screen changing), on the desktop's xterm, before the first move (the page's console on the capsule's own host,
and a VNC client on the capsule's VNC unix socket) and right after it (the page's console that followed the
capsule, relayed through the source's agent to the destination's, and the same client on the destination's
socket).

    .venv/bin/python bench/click_to_console.py [--runs 5] [--keys 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import image_stores, median, table, temp_workdir, write_result  # noqa: E402
from bench.console_latency import BACKSPACE, _page_sample, _sample, direct, through_agent  # noqa: E402
from bench.dashboard_migrate import _cli  # noqa: E402
from bench.rfb import KEY_A  # noqa: E402
from capsule import capsules, hosts, lifecycle  # noqa: E402
from capsule.agent.launch import AgentProcess  # noqa: E402
from capsule.console import guestx  # noqa: E402
from capsule.imagebuild.desktop import DESKTOP_MARKER, USER  # noqa: E402
from capsule.runtime.connection import lookup_domain  # noqa: E402
from capsule.store import Store  # noqa: E402
from testkit.chromium import launch  # noqa: E402
from tests.helpers.dashboard import open_console, sign_in  # noqa: E402

NAME = "desk"
BOOT_TIMEOUT = 600.0
# as the session's user: a maximised terminal with a shell, whose echo of a typed key is what changes the screen
TERMINAL = ("export DISPLAY=:0 XAUTHORITY=$HOME/.Xauthority LANG=C.UTF-8;"
            " setsid xterm -maximized -e sh </dev/null >/dev/null 2>&1 &")

# before the click: note the click on Migrate, then on every animation frame whether the dialog says done, the
# console says connected to the destination, and the followed console's canvas holds a drawn pixel
WATCH = """(peer) => {
  const w = window.__cc = {click: null, done: null, connected: null, frame: null};
  const old = document.querySelector('#console-screen canvas');
  const button = document.querySelector('#migrate-dialog [data-action="start-migration"]');
  button.addEventListener('click', () => { w.click = performance.now(); }, {capture: true, once: true});
  const drawn = (c) => {
    if (!c.width || !c.height) return false;
    const d = c.getContext('2d', {willReadFrequently: true}).getImageData(0, 0, c.width, c.height).data;
    for (let i = 3; i < d.length; i += 4 * 97) if (d[i] !== 0) return true;
    return false;
  };
  const look = () => {
    const now = performance.now();
    if (w.click !== null) {
      const msg = document.querySelector('#migrate-dialog .migrate-message');
      if (w.done === null && msg && msg.dataset.outcome === 'done') w.done = now;
      const here = document.querySelector('#console').dataset.peer === peer;
      if (w.connected === null && here && document.querySelector('#console-state').dataset.state === 'connected')
        w.connected = now;
      const c = document.querySelector('#console-screen canvas');
      if (here && c && c !== old && drawn(c)) { w.frame = now; return; }
    }
    requestAnimationFrame(look);
  };
  requestAnimationFrame(look);
}"""


def _terminal(store: Store) -> None:
    """Wait for the desktop session, then open the maximised terminal in it."""
    log = store.instance_dir(NAME) / "console.log"
    t0 = time.monotonic()
    while not (log.exists() and DESKTOP_MARKER.encode() in log.read_bytes()):
        if time.monotonic() - t0 > BOOT_TIMEOUT:
            raise SystemExit(f"no {DESKTOP_MARKER} on the serial console within {BOOT_TIMEOUT:.0f} s")
        time.sleep(1)
    with guestx.agent(store, NAME, "bench") as ga:
        r = guestx.run(ga, NAME, "bench", ["runuser", "-l", USER, "-c", TERMINAL])
    if r["exit_code"] != 0:
        raise SystemExit(f"the terminal did not start: {r}")
    time.sleep(5)


def _focus(page: Any) -> None:
    """The console's keyboard focus, and the pointer on the terminal (the X focus)."""
    page.locator("#console-screen canvas").click()
    page.wait_for_timeout(500)


def turns(page: Any, rfb: Any, way: str, keys: int) -> dict[str, list[float]]:
    """``keys`` samples each of the page's console and the VNC client ``rfb`` (named ``way``), taking turns, keys
    alternately ``a`` and BackSpace."""
    out: dict[str, list[float]] = {way: [], "page": []}
    arrivals: list[float] = []
    for i in range(keys):
        for j, w in enumerate((way, "page") if i % 2 == 0 else ("page", way)):
            key = KEY_A if (2 * i + j) % 2 == 0 else BACKSPACE
            out[w].append(_sample(rfb, key) if w == way else _page_sample(page, key, arrivals))
            time.sleep(0.25)
    return out


def _latency(page: Any, store: Store, keys: int) -> dict[str, list[float]]:
    """``keys`` samples each of the page's console and a VNC client on the capsule's unix socket, taking turns."""
    with direct(store, NAME) as rfb:
        return turns(page, rfb, "direct", keys)


def _page_move(page: Any, to: str) -> dict[str, float]:
    """On a page signed in on the capsule's host: open the capsule's console, migrate it to the peer ``to`` from
    the dialog; seconds from the click to the dialog saying done, the console connected there, its first frame
    drawn."""
    from playwright.sync_api import expect

    row = open_console(page, NAME, timeout_ms=60_000)
    expect(page.locator(f'section[data-host="{to}"]')).to_have_attribute("data-reachable", "yes", timeout=30_000)
    page.wait_for_timeout(1000)
    row.locator('button[data-action="migrate"]').click()
    dialog = page.locator("#migrate-dialog")
    page.select_option("#migrate-to", to)
    # one machine, one libvirtd: the pre-check refuses a live move and the dialog falls back to Offline: full
    expect(dialog.locator('input[name="kind"][value="live"]')).to_be_disabled(timeout=30_000)
    expect(dialog.locator('input[name="kind"][value="full"]')).to_be_checked()
    page.evaluate(WATCH, to)
    dialog.locator('[data-action="start-migration"]').click()
    page.wait_for_function("() => window.__cc.frame !== null", timeout=300_000, polling=200)
    w = page.evaluate("window.__cc")
    if page.locator("#migrate-dialog .migrate-message").get_attribute("data-outcome") != "done":
        raise SystemExit("the dialog did not say done")
    dialog.locator('[data-action="close-migration"]').click()
    return {k: round((w[k] - w["click"]) / 1000, 3) for k in ("done", "connected", "frame")}


def _cli_move(home: Path, to: str, agent: AgentProcess) -> dict[str, float]:
    """`capsule migrate` to ``to``, then a VNC client on the console there: seconds from the process's start to
    its exit, to the client's first framebuffer update; the library's own time for the move."""
    t0 = time.monotonic()
    _wall, library = _cli(home, to, False, name=NAME)
    exited = time.monotonic() - t0
    with through_agent(agent, NAME) as rfb:
        rfb.request(False)
        rfb.update()
        frame = time.monotonic() - t0
    return {"exited": round(exited, 3), "frame": round(frame, 3), "library": round(library, 3)}


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": round(median(xs), 2), "p90": round(sorted(xs)[int(0.9 * (len(xs) - 1))], 2)}


def report(name: str, title: str, head: dict[str, Any], page_runs: list[dict[str, Any]],
           cli_runs: list[dict[str, Any]], latency: dict[str, dict[str, list[float]]], client: dict[str, str]) -> None:
    """Write the result ``name`` (``head``, the runs, their medians, the latency samples and their statistics)
    and print its two tables; ``client``: the VNC client's way in the latency samples and its label."""
    def med(runs: list[dict[str, Any]], key: str) -> float:
        return round(median([r[key] for r in runs]), 3)

    result = head | {
        "ram_bytes": 1 << 30, "image": "desktop", "page_seconds": page_runs, "cli_seconds": cli_runs,
        "median_seconds": {"page_click_to_done": med(page_runs, "done"),
                           "page_click_to_connected": med(page_runs, "connected"),
                           "page_click_to_first_frame": med(page_runs, "frame"),
                           "cli_process": med(cli_runs, "exited"), "cli_library": med(cli_runs, "library"),
                           "cli_to_first_frame": med(cli_runs, "frame")},
        "latency_ms": {when: {way: [round(x, 2) for x in xs] for way, xs in ways.items()}
                       for when, ways in latency.items()},
        "latency": {when: {way: _stats(xs) for way, xs in ways.items()} for when, ways in latency.items()},
    }
    m = result["median_seconds"]
    result["page_vs_cli_first_frame"] = round(m["page_click_to_first_frame"] - m["cli_to_first_frame"], 3)
    path = write_result(name, result)
    table(f"{title}: median of {head['runs']} (seconds)", ["", "move done", "console there", "first frame"],
          [["dashboard: click → (followed console)", f"{m['page_click_to_done']:.2f}",
            f"{m['page_click_to_connected']:.2f}", f"{m['page_click_to_first_frame']:.2f}"],
           ["capsule migrate + VNC client there", f"{m['cli_process']:.2f} (library {m['cli_library']:.2f})",
            "–", f"{m['cli_to_first_frame']:.2f}"]])
    lat = result["latency"]
    table("console latency, key typed → screen changed (ms)", ["", "median before", "median after", "p90 after"],
          [[label, f"{lat['before'][way]['median']:.1f}", f"{lat['after'][way]['median']:.1f}",
            f"{lat['after'][way]['p90']:.1f}"]
           for way, label in (*client.items(), ("page", "noVNC in the page (after: followed, relayed)"))])
    print(f"page − CLI to first frame: {result['page_vs_cli_first_frame']:+.2f}s; written to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs (each moves the capsule once from the page, once "
                                                        "with the CLI)")
    ap.add_argument("--keys", type=int, default=30, help="console latency: keys typed per way, before and after")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with temp_workdir("capsule-bench-") as tmp:
        a, b = image_stores("desktop", Path(tmp) / "a", Path(tmp) / "b")
        agent_a = AgentProcess(a.home, Path(tmp) / "a.token")
        agent_b = AgentProcess(b.home, Path(tmp) / "b.token")
        side = {"a": (a, agent_a), "b": (b, agent_b)}
        page_runs: list[dict[str, float | str]] = []
        cli_runs: list[dict[str, float | str]] = []
        latency: dict[str, dict[str, list[float]]] = {}
        try:
            hosts.add(a, "b", agent_b.url, agent_b.token)
            hosts.add(b, "a", agent_a.url, agent_a.token)
            capsules.create(a, NAME, "desktop", memory="1G")
            lifecycle.start(a, NAME, timeout=BOOT_TIMEOUT)
            _terminal(a)
            with sync_playwright() as p:
                browser = launch(p)
                at = "a"                                         # where the capsule runs
                for i in range(args.runs):
                    for way in (("page", "cli") if i % 2 == 0 else ("cli", "page")):
                        to = "b" if at == "a" else "a"
                        if way == "page":
                            page = browser.new_page(viewport={"width": 1280, "height": 900})
                            sign_in(page, side[at][1].url, side[at][1].token)
                            if not latency:
                                open_console(page, NAME, timeout_ms=60_000)
                                page.wait_for_timeout(2000)
                                _focus(page)
                                latency["before"] = _latency(page, a, args.keys)
                            got = _page_move(page, to)
                            if "after" not in latency:
                                page.wait_for_timeout(2000)
                                _focus(page)
                                latency["after"] = _latency(page, side[to][0], args.keys)
                            page.close()
                            page_runs.append(got | {"direction": f"{at}->{to}"})
                        else:
                            got = _cli_move(side[at][0].home, to, side[to][1])
                            cli_runs.append(got | {"direction": f"{at}->{to}"})
                        print(f"run {i + 1} {way} {at} → {to}: {got}", flush=True)
                        at = to
                browser.close()
        finally:
            for s in (a, b):
                d = lookup_domain(s.domain_name(NAME))
                if d is not None:
                    d.destroy()
            agent_a.stop()
            agent_b.stop()

    report("click_to_console", "desktop capsule moved between two agents on this machine",
           {"runs": args.runs, "keys": args.keys,
            "kind": "offline full (one machine, one libvirtd: live refused by the pre-check)"},
           page_runs, cli_runs, latency, {"direct": "VNC client on the unix socket"})

if __name__ == "__main__":
    main()
