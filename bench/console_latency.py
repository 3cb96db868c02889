"""Console latency: the time from a key typed to the guest's screen changing, three ways, same guest, same run.

A 256 MiB tiny guest runs an interactive shell on its first virtual terminal (the VGA screen), cursor
hidden, so the only thing that changes the screen is the echo of a typed key. Each sample types one key
(alternately `a` and BackSpace) and waits for the screen to change; the three are connected at once and
take turns, sample by sample:

- direct: a VNC client (bench/rfb.py) on the capsule's VNC unix socket — the floor;
- agent: the same client through the agent's ticketed console WebSocket (what the page talks to);
- page: noVNC in Debian's chromium, signed in to the dashboard, the key dispatched to noVNC's canvas and
  the canvas's pixels watched on every animation frame.

QEMU's VNC server sends an update only when the screen changed, and checks for changes on a timer it
slows down while nothing changes; that timer is in all three.

    .venv/bin/python bench/console_latency.py [--samples 40]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, table, temp_workdir, tiny_stores, write_result  # noqa: E402
from bench.rfb import KEY_A, Rfb  # noqa: E402
from capsule import capsules, lifecycle  # noqa: E402
from capsule.agent.launch import AgentProcess  # noqa: E402
from capsule.console import screen  # noqa: E402
from capsule.console.serial import ConsoleSession  # noqa: E402
from capsule.runtime.connection import lookup_domain  # noqa: E402
from capsule.store import Store  # noqa: E402
from testkit.chromium import launch  # noqa: E402

NAME = "latency"
BACKSPACE = 0xFF08
# an interactive shell on tty1 (the screen), its cursor hidden: a typed key's echo is the only change
SHELL_ON_SCREEN = ("printf '\\033[2J\\033[H\\033[?25l' > /dev/tty1; "
                   "setsid sh -c 'exec sh -i </dev/tty1 >/dev/tty1 2>&1' >/dev/null 2>&1 &")

# before the page loads: note when each console WebSocket message arrives (to split the page's time)
WS_TIMES = """(() => {
  const Orig = window.WebSocket;
  window.__wsLast = 0;
  window.WebSocket = function (...args) {
    const ws = new Orig(...args);
    ws.addEventListener('message', () => { window.__wsLast = performance.now(); });
    return ws;
  };
  window.WebSocket.prototype = Orig.prototype;
  Object.assign(window.WebSocket, Orig);
})();"""

# in the page: type a key into noVNC's canvas, then watch the canvas until its pixels change (ms)
PAGE_SAMPLE = """async (code) => {
  const c = document.querySelector('#console-screen canvas');
  const ctx = c.getContext('2d', {willReadFrequently: true});
  const sum = () => { const d = ctx.getImageData(0, 0, c.width, c.height).data; let s = 0;
                      for (let i = 0; i < d.length; i += 8) s = (Math.imul(s, 31) + d[i]) >>> 0; return s; };
  const before = sum();
  const key = code === 'KeyA' ? 'a' : 'Backspace';
  const t0 = performance.now();
  window.__wsLast = 0;
  c.dispatchEvent(new KeyboardEvent('keydown', {key, code, bubbles: true, cancelable: true}));
  c.dispatchEvent(new KeyboardEvent('keyup', {key, code, bubbles: true, cancelable: true}));
  return await new Promise((resolve) => {
    const look = () => {
      if (sum() !== before) resolve([performance.now() - t0, window.__wsLast ? window.__wsLast - t0 : null]);
      else if (performance.now() - t0 > 10000) resolve(null);
      else requestAnimationFrame(look);
    };
    requestAnimationFrame(look);
  });
}"""


def _sample(rfb: Rfb, keysym: int) -> float:
    """One key through ``rfb``: first a full update (what changed while another client typed is not counted),
    then the key and the first incremental update that carries pixels (ms)."""
    rfb.request(False)
    rfb.update()
    rfb.request(True)
    t0 = time.perf_counter()
    rfb.key(keysym)
    while rfb.update() == 0:
        rfb.request(True)
    return (time.perf_counter() - t0) * 1000


@contextmanager
def direct(store: Store, name: str = NAME) -> Iterator[Rfb]:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(screen.vnc_socket(store, name)))
        s.settimeout(10)
        rfb = Rfb(s.sendall, lambda: s.recv(1 << 16))
        rfb.handshake()
        yield rfb


class Reachable(Protocol):
    """An agent to call: a launched one (AgentProcess) or a compose host's (scripts.composehosts.Host)."""

    @property
    def url(self) -> str: ...

    @property
    def token(self) -> str: ...


@contextmanager
def through_agent(agent: Reachable, name: str = NAME) -> Iterator[Rfb]:
    from websockets.sync.client import connect

    auth = {"Authorization": f"Bearer {agent.token}"}
    req = urllib.request.Request(f"{agent.url}/api/capsules/{name}/console-ticket", data=b"{}", method="POST",
                                 headers=auth | {"Content-Type": "application/json"})
    ticket = json.loads(urllib.request.urlopen(req, timeout=10).read())["ticket"]
    url = agent.url.replace("http://", "ws://") + f"/api/console/{name}?ticket={ticket}"
    with connect(url, additional_headers=auth, max_size=None, open_timeout=10) as ws:
        rfb = Rfb(ws.send, lambda: ws.recv(timeout=10, decode=False))
        rfb.handshake()
        yield rfb


@contextmanager
def in_page(agent: AgentProcess) -> Iterator[Any]:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = launch(p)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.add_init_script(WS_TIMES)
        page.goto(agent.url)
        page.fill("#token", agent.token)
        page.click("#sign-in-form button[type=submit]")
        page.locator(f'section[data-host="local"] tr[data-capsule="{NAME}"] [data-action="console"]').click()
        expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=30_000)
        time.sleep(1.0)
        yield page
        browser.close()


def _page_sample(page: Any, keysym: int, arrivals: list[float]) -> float:
    got = page.evaluate(PAGE_SAMPLE, "KeyA" if keysym == KEY_A else "Backspace")
    if got is None:
        raise RuntimeError("the page's canvas did not change within 10 s of a key")
    if got[1] is not None:
        arrivals.append(got[1])
    return float(got[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=30, help="samples per way")
    args = ap.parse_args()
    with temp_workdir("capsule-bench-") as tmp:
        [store] = tiny_stores(Path(tmp) / "a")
        agent = AgentProcess(store.home, Path(tmp) / "a.token")
        rows: dict[str, list[float]] = {}
        arrivals: list[float] = []     # in the page: key → the update's first WebSocket message
        try:
            capsules.create(store, NAME, "tiny", memory="256M")
            lifecycle.start(store, NAME)
            with ConsoleSession(store.domain_name(NAME)) as c:
                c.run(SHELL_ON_SCREEN)
            time.sleep(1.0)
            # all three connected at once; the samples go round them, so the server's adaptive refresh timer
            # and the machine's load fall on each alike
            with direct(store) as d_rfb, through_agent(agent) as a_rfb, in_page(agent) as page:
                ways: list[tuple[str, Callable[[int], float]]] = [
                    ("direct", lambda k: _sample(d_rfb, k)), ("agent", lambda k: _sample(a_rfb, k)),
                    ("page", lambda k: _page_sample(page, k, arrivals))]
                for i in range(args.samples):
                    for j, (way, take) in enumerate(ways[i % 3:] + ways[:i % 3]):
                        rows.setdefault(way, []).append(take(KEY_A if (3 * i + j) % 2 == 0 else BACKSPACE))
                        time.sleep(0.25)
        finally:
            d = lookup_domain(store.domain_name(NAME))
            if d is not None:
                d.destroy()
            agent.stop()
    med = {k: median(v) for k, v in rows.items()}
    p90 = {k: sorted(v)[int(0.9 * (len(v) - 1))] for k, v in rows.items()}
    result = {"samples": args.samples, "ms": {k: [round(x, 2) for x in v] for k, v in rows.items()},
              "median_ms": {k: round(v, 2) for k, v in med.items()}, "p90_ms": {k: round(v, 2) for k, v in p90.items()},
              "agent_added_ms": round(med["agent"] - med["direct"], 2),
              "page_added_ms": round(med["page"] - med["direct"], 2),
              "page_message_arrived_median_ms": round(median(arrivals), 2) if arrivals else None}
    path = write_result("console_latency", result)
    table("key typed → screen changed (ms)", ["", "median", "p90", "added to direct"],
          [["VNC client on the unix socket (direct)", f"{med['direct']:.1f}", f"{p90['direct']:.1f}", "–"],
           ["same client through the agent's WebSocket", f"{med['agent']:.1f}", f"{p90['agent']:.1f}",
            f"{result['agent_added_ms']:+.1f}"],
           ["noVNC in the page, through the agent", f"{med['page']:.1f}", f"{p90['page']:.1f}",
            f"{result['page_added_ms']:+.1f}"]])
    if arrivals:
        print(f"in the page the update's first WebSocket message arrived after {median(arrivals):.1f} ms (median); "
              f"the rest is noVNC decoding and drawing and the browser's next frame")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
