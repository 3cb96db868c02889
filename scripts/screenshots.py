"""The README's pictures of a desktop user's day, taken by Chromium on two hosts on this machine.

Two stores with the desktop image, each with its own agent on loopback ("work" and "home"), each knowing the
other as a peer. The capsule "desk" starts at work; a user with the operator role signs in on each host's page
and the script takes, at a 1280×800 viewport:

1. ``desktop-at-work.png``: work's page, desk running, its console showing the desktop's terminal with lines typed;
2. ``bring-here.png``: home's page, work's card listing desk with its Bring here button;
3. ``brought-home.png``: the move done from home's page, the console there showing the same terminal;
4. ``clipboard.png``: a text sent through the clipboard box and pasted into the terminal (Shift+Insert);
5. ``resized.png``: the window at 1024×700, the guest's resolution following the console panel.

Each step waits for its expected state (read in the guest through the guest agent where it can); if one does
not come, the script says which and exits with 1. Domains and agents are cleaned up on every exit.
Run as root (libvirt's system connection): ``python scripts/screenshots.py [--out docs/img]``."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from capsule import capsules, hosts, lifecycle
from capsule.accounts import users
from capsule.agent.launch import AgentProcess
from capsule.console.screen import screenshot
from capsule.errors import Error
from capsule.store import Store
from testkit.chromium import CHROMIUM
from testkit.desktop import AT, CANVAS, CONSOLE_IN_VIEW, TEE, TYPED, terminal_top_left, typed_lines
from testkit.images import destroy_domains, ensure_image, image_store, make_store
from tests.wait import wait_until

ROOT = Path(__file__).resolve().parent.parent
VIEWPORT = {"width": 1280, "height": 800}
NARROW = {"width": 1024, "height": 700}
MAX_BYTES = 250 * 1024          # each picture at most this large
USER, PASSWORD = "ada", "ada's password for the pictures"
LINES = ["good-morning-from-work", "still-here-at-home", "pasted from the clipboard box"]
WAIT_MS = 60_000


class StepFailed(Exception):
    """A step did not reach the state it waits for."""


@dataclass
class Host:
    name: str
    store: Store
    agent: AgentProcess


@contextlib.contextmanager
def two_hosts(root: Path) -> Iterator[tuple[Host, Host]]:
    """Stores "work" and "home" under ``root``, both holding the desktop image, each with its agent and a user
    with the operator role, each the other's peer; the domains destroyed and agents stopped on leaving."""
    source = image_store()
    ensure_image(source, "desktop")
    made: list[Host] = []
    try:
        for name in ("work", "home"):
            store = make_store(root / name / "store", source, "desktop")
            made.append(Host(name, store, AgentProcess(store.home, root / name / "t.token")))
            users.add(store, USER, "operator", PASSWORD)
        work, home = made
        hosts.add(work.store, "home", home.agent.url, home.agent.token)
        hosts.add(home.store, "work", work.agent.url, work.agent.token)
        yield work, home
    finally:
        for host in made:
            host.agent.stop()
            destroy_domains(host.store)
            host.store.close()
        source.close()


def step(what: str) -> None:
    print(f"==> {what}", flush=True)


def wait(predicate: Any, timeout: float, what: str) -> Any:
    try:
        return wait_until(predicate, timeout, what, interval=0.5)
    except AssertionError as e:
        raise StepFailed(str(e)) from None


def expecting(what: str) -> contextlib.AbstractContextManager[None]:
    """Turn a Playwright expectation or timeout inside into :class:`StepFailed` naming ``what``."""
    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        from playwright.sync_api import Error as PlaywrightError

        try:
            yield
        except (AssertionError, PlaywrightError) as e:
            raise StepFailed(f"{what}: {str(e).splitlines()[0]}") from None
    return guard()


def sign_in(page: Any, host: Host) -> None:
    from playwright.sync_api import expect

    page.goto(host.agent.url)
    page.fill("#user", USER)
    page.fill("#password", PASSWORD)
    page.click("#sign-in-form button[type=submit]")
    with expecting(f"{USER} signed in on {host.name}'s page"):
        expect(page.locator("#whoami")).to_contain_text(f"{USER} (operator)", timeout=WAIT_MS)


def console_fits(page: Any, store: Store) -> None:
    """The console connected, its guest's resolution following the panel: the canvas as wide as the panel (to
    the 16 columns the width is rounded to) and the guest's screen that size."""
    from playwright.sync_api import expect

    with expecting("the console connected and fitted to its panel"):
        expect(page.locator("#console-state")).to_have_attribute("data-state", "connected", timeout=WAIT_MS)
        expect(page.locator("#console")).to_have_attribute("data-fit", "guest", timeout=WAIT_MS)
    panel = page.evaluate(CANVAS)
    want = (min(panel["cw"], 2560) // 16 * 16, max(400, min(panel["ch"], 1600)))

    def guest_size() -> tuple[int, int]:
        shot = screenshot(store, "desk")
        return shot.width, shot.height

    wait(lambda: guest_size() == want, 60, f"the guest's screen at {want} (the console panel's size)")
    with expecting(f"the console's canvas at {want}"):
        page.wait_for_function(f"() => {{ const c = document.querySelector('#console-screen canvas');"
                               f" return c && c.width === {want[0]} && c.height === {want[1]}; }}", timeout=WAIT_MS)


def into_terminal(page: Any, store: Store) -> None:
    """Click into the guest's terminal (found on its screen): it has the keyboard."""
    left, top = wait(lambda: terminal_top_left(store, "desk"), 60, "the terminal on the guest's screen")
    page.evaluate(CONSOLE_IN_VIEW)
    page.mouse.click(*page.evaluate(AT, [left + 80, top + 40]))
    page.wait_for_timeout(500)


def type_line(page: Any, store: Store, line: str, want: list[str]) -> None:
    page.keyboard.type(line, delay=20)
    page.keyboard.press("Enter")
    wait(lambda: typed_lines(store, "desk") == want, 60, f"{want} in the guest's {TYPED}")


# scroll so that the console card's title is at the top and, as far as the viewport reaches, the capsule's row shows
SCROLL = """(row) => {
  const top = document.querySelector('#console').getBoundingClientRect().top;
  const r = document.querySelector(row);
  const bottom = r ? r.getBoundingClientRect().bottom : top;
  window.scrollBy(0, Math.max(0, Math.min(top - 8, bottom - window.innerHeight + 8)));
}"""


def show_console(page: Any, row: str) -> None:
    page.evaluate("() => window.scrollTo(0, 0)")
    page.evaluate(SCROLL, row)
    page.wait_for_timeout(1500)        # the next frames drawn


def shoot(page: Any, out: Path, name: str) -> Path:
    path = out / name
    page.screenshot(path=str(path))
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise StepFailed(f"{path} is {size} B, more than {MAX_BYTES} B")
    step(f"{path}: {size} B")
    return path


def day(work: Host, home: Host, browser: Any, out: Path) -> list[Path]:
    from playwright.sync_api import expect

    shots: list[Path] = []
    step("desk starts at work")
    capsules.create(work.store, "desk", "desktop", memory="1G")
    lifecycle.start(work.store, "desk", timeout=600)

    step("1. work's page, desk's console, lines typed into its terminal")
    at_work = browser.new_page(viewport=VIEWPORT)
    sign_in(at_work, work)
    row = at_work.locator('section[data-host="local"] tr[data-capsule="desk"]')
    with expecting("desk listed running on work's page"):
        expect(row.locator(".badge")).to_have_attribute("data-state", "running", timeout=WAIT_MS)
    row.locator('button[data-action="console"]').click()
    console_fits(at_work, work.store)
    into_terminal(at_work, work.store)
    at_work.keyboard.type(TEE, delay=20)
    at_work.keyboard.press("Enter")
    type_line(at_work, work.store, LINES[0], LINES[:1])
    show_console(at_work, 'section[data-host="local"] tr[data-capsule="desk"]')
    shots.append(shoot(at_work, out, "desktop-at-work.png"))
    at_work.close()

    step("2. home's page: work's desk with its Bring here button")
    page = browser.new_page(viewport=VIEWPORT)
    sign_in(page, home)
    peer_row = page.locator('section[data-host="work"] tr[data-capsule="desk"]')
    button = peer_row.locator('button[data-action="bring"]')
    with expecting("work's desk listed running on home's page, its Bring here button enabled"):
        expect(peer_row.locator(".badge")).to_have_attribute("data-state", "running", timeout=WAIT_MS)
        expect(button).to_be_enabled(timeout=WAIT_MS)
    with contextlib.suppress(Exception):       # the peer's hierarchy, when the tree card is shown
        page.locator("#tree-host").select_option("work", timeout=5_000)
    page.evaluate("() => document.querySelector('section[data-host=\"work\"]').scrollIntoView()")
    page.wait_for_timeout(1000)
    shots.append(shoot(page, out, "bring-here.png"))

    step("3. Bring here: desk moves home, the console follows it")
    button.click()
    dialog = page.locator("#bring-dialog")
    with expecting("the Bring here dialog"):
        expect(dialog).to_be_visible(timeout=WAIT_MS)
        dialog.locator('input[name="kind"][value="full"]').check()   # one machine: Live is refused (same host)
    dialog.locator('[data-action="start-bring"]').click()
    progress = page.locator("#migrate-dialog")
    message = progress.locator(".migrate-message")
    started = time.monotonic()
    with expecting("the move done"):
        expect(message).to_have_attribute("data-outcome", "done", timeout=400_000)
        expect(message).to_contain_text("now runs here")
    step(f"the move took {time.monotonic() - started:.0f} s")
    progress.locator('[data-action="close-migration"]').click()
    if capsules.state_of(home.store, "desk").state != "running":
        raise StepFailed("desk is not running at home after the move")
    console_fits(page, home.store)
    wait(lambda: typed_lines(home.store, "desk") == LINES[:1], 60, f"{LINES[:1]} in the guest's {TYPED} at home")
    into_terminal(page, home.store)
    type_line(page, home.store, LINES[1], LINES[:2])
    show_console(page, 'section[data-host="local"] tr[data-capsule="desk"]')
    shots.append(shoot(page, out, "brought-home.png"))

    step("4. the clipboard box: a text sent to the guest, pasted into the terminal")
    page.fill("#console-clip-text", LINES[2])
    page.click("#console-clip-send")
    with expecting("the clipboard box's text sent"):
        expect(page.locator("#console-clip-state")).to_have_attribute("data-state", "sent", timeout=WAIT_MS)
    into_terminal(page, home.store)
    page.keyboard.press("Shift+Insert")
    page.keyboard.press("Enter")
    wait(lambda: typed_lines(home.store, "desk") == LINES, 60, f"{LINES} in the guest's {TYPED}")
    show_console(page, 'section[data-host="local"] tr[data-capsule="desk"]')
    shots.append(shoot(page, out, "clipboard.png"))

    step(f"5. the window at {NARROW['width']}×{NARROW['height']}: the guest's resolution follows")
    page.set_viewport_size(NARROW)
    console_fits(page, home.store)
    show_console(page, 'section[data-host="local"] tr[data-capsule="desk"]')
    scroll = page.evaluate("() => { const e = document.querySelector('#console-screen');"
                           " return [e.scrollWidth - e.clientWidth, e.scrollHeight - e.clientHeight]; }")
    if scroll != [0, 0]:
        raise StepFailed(f"the console panel scrolls by {scroll} at {NARROW}")
    shots.append(shoot(page, out, "resized.png"))
    return shots


def main(out: Annotated[Path, typer.Option("--out", help="Where the PNG files go (created).")] = ROOT / "docs" / "img",
         keep: Annotated[bool, typer.Option("--keep", help="Keep the stores and the agents' logs.")] = False) -> None:
    """Take the README's pictures of a desktop user's day: start at work, bring it home, copy and paste,
    resize. Boots the desktop image (slow under TCG); exits 1 naming the step that did not get its state."""
    if os.geteuid() != 0:
        raise SystemExit("screenshots.py runs as root (it starts guests through libvirt's system connection)")
    if not CHROMIUM.exists():
        raise SystemExit(f"{CHROMIUM} is missing: the pictures are taken with Debian's chromium")
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="capsule-screenshots-"))
    root.chmod(0o755)                  # QEMU, unprivileged, reaches the stores' files
    started = time.monotonic()
    failed: str | None = None
    try:
        with two_hosts(root) as (work, home), sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
            try:
                shots = day(work, home, browser, out)
            except Exception:
                for i, page in enumerate(browser.contexts[-1].pages if browser.contexts else []):
                    with contextlib.suppress(Exception):
                        page.screenshot(path=str(root / f"failed-{i}.png"))
                raise
            finally:
                browser.close()
    except (StepFailed, Error) as e:
        failed = str(e)
    except Exception as e:                 # noqa: BLE001 - Playwright's own errors: said in one line, not a trace
        if type(e).__module__.split(".")[0] != "playwright":
            raise
        failed = f"the browser: {str(e).splitlines()[0]}"
    finally:
        if keep or failed:
            print(f"the stores and agents' logs: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if failed:
        print(f"screenshots.py: FAILED: {failed}", file=sys.stderr)
        raise SystemExit(1)
    print(f"done in {time.monotonic() - started:.0f} s: " + ", ".join(f"{s.name} {s.stat().st_size} B" for s in shots))


if __name__ == "__main__":
    typer.run(main)
