"""Migrating from the dashboard against `capsule migrate` from the CLI, same capsule, same run.

Two stores with the tiny image and two agents on loopback; a 256 MiB tiny guest with a counter running
on host A. Each round (alternating which goes first) moves it A → B once with the CLI (`capsule migrate
NAME --to B`, a process timed from start to exit) and once with the page (Debian's chromium via
Playwright, signed in on A: from the click on "Migrate" in the dialog to the dialog saying it runs on
B), and brings it back B → A with the library call in between (not timed). For both it also reports
the library's own time (the migration's last progress event), so "added" is what the CLI process or
the page adds on top of the same library call.

    .venv/bin/python bench/dashboard_migrate.py [--rounds 4] [--balloon]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, table, temp_workdir, tiny_stores, write_result  # noqa: E402
from capsule import capsules, hosts, lifecycle  # noqa: E402
from capsule.agent.launch import AgentProcess  # noqa: E402
from capsule.console.serial import ConsoleSession  # noqa: E402
from capsule.migrate import migrate  # noqa: E402
from capsule.runtime.connection import lookup_domain  # noqa: E402
from testkit.chromium import launch  # noqa: E402

COUNTER = "(i=0; : > /tmp/count; while true; do i=$((i+1)); echo $i 1<> /tmp/count; sleep 0.2; done) >/dev/null 2>&1 &"
NAME = "bench"


def _cli(home: Path, to: str, balloon: bool, name: str = NAME) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "capsule.cli.main", "--home", str(home), "--json", "migrate", name, "--to", to,
           "--offline", *(["--balloon"] if balloon else [])]   # (the two hosts share this machine's libvirtd)
    t = time.monotonic()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(
        Path(__file__).resolve().parent.parent)})
    wall = time.monotonic() - t
    return wall, json.loads(out.stdout)["progress"]["elapsed"]


def _page(page, balloon: bool) -> tuple[float, float]:
    from playwright.sync_api import expect

    row = page.locator(f'section[data-host="local"] tr[data-capsule="{NAME}"]')
    expect(row.locator(".badge")).to_have_attribute("data-state", "running", timeout=60_000)
    row.locator('button[data-action="migrate"]').click()
    dialog = page.locator("#migrate-dialog")
    expect(dialog.locator("#migrate-to")).to_have_value("b")
    if balloon:
        dialog.locator('input[name="balloon"]').check()
    t = time.monotonic()
    dialog.locator('[data-action="start-migration"]').click()
    expect(dialog.locator(".migrate-message")).to_have_attribute("data-outcome", "done", timeout=300_000)
    wall = time.monotonic() - t
    elapsed = page.evaluate("fetch('/api/migrations').then(r => r.json()).then(l => l[0].progress.elapsed)")
    dialog.locator('[data-action="close-migration"]').click()
    return wall, float(elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--balloon", action="store_true")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with temp_workdir("capsule-bench-") as tmp:
        a, b = tiny_stores(Path(tmp) / "a", Path(tmp) / "b")
        agent_a = AgentProcess(a.home, Path(tmp) / "a.token")
        agent_b = AgentProcess(b.home, Path(tmp) / "b.token")
        rows: dict[str, list[float]] = {k: [] for k in ("cli_wall", "cli_library", "page_wall", "page_library")}
        try:
            hosts.add(a, "b", agent_b.url, agent_b.token)
            capsules.create(a, NAME, "tiny", memory="256M")
            lifecycle.start(a, NAME)
            with ConsoleSession(a.domain_name(NAME)) as c:
                c.run(COUNTER)

            def back() -> None:
                migrate(b, NAME, agent_a.url, agent_a.token)
                assert lookup_domain(a.domain_name(NAME)) is not None

            with sync_playwright() as p:
                browser = launch(p)
                page = browser.new_page()
                page.goto(agent_a.url)
                page.fill("#token", agent_a.token)
                page.click("#sign-in-form button[type=submit]")
                for i in range(args.rounds):
                    for way in (("cli", "page") if i % 2 == 0 else ("page", "cli")):  # neither always first
                        if way == "cli":
                            wall, lib = _cli(a.home, "b", args.balloon)
                        else:
                            page.reload()
                            wall, lib = _page(page, args.balloon)
                        rows[f"{way}_wall"].append(wall)
                        rows[f"{way}_library"].append(lib)
                        back()
                browser.close()
        finally:
            for s in (a, b):
                for dom in (s.domain_name(NAME),):
                    d = lookup_domain(dom)
                    if d is not None:
                        d.destroy()
            agent_a.stop()
            agent_b.stop()
    med = {k: median(v) for k, v in rows.items()}
    result = {"rounds": args.rounds, "balloon": args.balloon, "ram_bytes": 256 << 20,
              "seconds": {k: [round(x, 3) for x in v] for k, v in rows.items()},
              "median": {k: round(v, 3) for k, v in med.items()},
              "cli_added": round(med["cli_wall"] - med["cli_library"], 3),
              "page_added": round(med["page_wall"] - med["page_library"], 3),
              "page_vs_cli": round(med["page_wall"] - med["cli_wall"], 3)}
    path = write_result("dashboard_migrate", result)
    table("migrate A → B: the page against the CLI (median seconds)", ["", "wall", "library", "added"],
          [["capsule migrate (CLI process)", f"{med['cli_wall']:.2f}", f"{med['cli_library']:.2f}",
            f"{result['cli_added']:.2f}"],
           ["dashboard (click → dialog says done)", f"{med['page_wall']:.2f}", f"{med['page_library']:.2f}",
            f"{result['page_added']:.2f}"]])
    print(f"page − CLI: {result['page_vs_cli']:+.2f}s; written to {path}")


if __name__ == "__main__":
    main()
