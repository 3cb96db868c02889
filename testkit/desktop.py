"""What the desktop image's tests and the README's pictures (scripts/screenshots.py) share: where the guest's
terminal is on its screen, a shell line that keeps what is typed into the terminal and reading that back through
the guest agent, and the console's canvas as the dashboard's page shows it."""

from __future__ import annotations

from capsule.console import guestx
from capsule.console.screen import screenshot
from capsule.store import Store

TYPED = "/tmp/typed"
# what the terminal's shell runs: every line typed after it is appended to TYPED (no character that needs Shift)
TEE = f"tee -a {TYPED}"

# the screen's canvas as the page shows it (CSS pixels) and the panel it sits in
CANVAS = """() => {
  const c = document.querySelector('#console-screen canvas');
  const p = document.querySelector('#console-screen').getBoundingClientRect();
  if (!c || !c.width) return null;
  const r = c.getBoundingClientRect();
  const e = document.querySelector('#console-screen');
  return {fbw: c.width, fbh: c.height, w: r.width, h: r.height, pw: p.width, ph: p.height, cw: e.clientWidth,
          ch: e.clientHeight};
}"""

# a guest pixel of the canvas: where it is on the page (CSS pixels), however the screen is scaled
AT = """([gx, gy]) => {
  const c = document.querySelector('#console-screen canvas');
  const r = c.getBoundingClientRect();
  return [r.left + (gx + 0.5) * r.width / c.width, r.top + (gy + 0.5) * r.height / c.height];
}"""

# the console card scrolled to the top of the page's viewport (the page may have scrolled, e.g. when the move's
# panel closed: a click at a canvas point off the viewport reaches nothing)
CONSOLE_IN_VIEW = "() => document.querySelector('#console').scrollIntoView()"


def terminal_top_left(store: Store, name: str) -> tuple[int, int] | None:
    """The top left corner of the terminal's white text area (the only large white region on the screen)."""
    shot = screenshot(store, name)
    white = b"\xff\xff\xff"
    rows = [shot.rgb[y * shot.width * 3:(y + 1) * shot.width * 3] for y in range(shot.height)]
    counts = [sum(row[i:i + 3] == white for i in range(0, len(row), 3)) for row in rows]
    top = next((y for y, n in enumerate(counts) if n > 200), None)
    if top is None:
        print("the most white pixels in a row:", max(counts), shot.width, shot.height, shot.colours().most_common(5))
        return None
    row = rows[top + 10]
    return next(x for x in range(shot.width) if row[x * 3:x * 3 + 3] == white), top


def typed_lines(store: Store, name: str) -> list[str]:
    """The lines in TYPED in the guest of capsule ``name``, read through the guest agent."""
    with guestx.agent(store, name, "test") as ga:
        r = guestx.run(ga, name, "test", ["sh", "-c", f"cat {TYPED} 2>/dev/null; true"])
    return r["stdout"].splitlines()


def pointer_at(store: Store, name: str) -> tuple[int, int]:
    """Where the guest's X server has its pointer (x, y), read through the guest agent."""
    from capsule.console import pointer

    return pointer.position(store, name)
