"""A running capsule's screen resolution, set from the console (the page asks for its panel's size): the guest's
X server changes its mode through RandR, run by the X helper through Capsule's guest agent (``guestx``), as
`xrandr` would. QEMU's VNC server then sends the new size to the page. This is the resize path because the
capsule's display, QEMU's standard VGA card, refuses a VNC client's SetDesktopSize (status 3, "invalid screen
layout", on QEMU 10.0); the page scales what it gets to fit, so a guest without an X session still fits."""

from __future__ import annotations

import math

from capsule.console import guestx
from capsule.errors import InvalidName
from capsule.store import Store

MIN_SIZE = (640, 400)
MAX_SIZE = (2560, 1600)
"""The resolutions asked for are brought within these (and within :data:`MAX_PIXELS`)."""
MAX_PIXELS = 8 * 1024 * 1024 // 4
"""The most pixels a screen may have: the guest's driver of the VGA card (16 MiB) takes a mode only if two frames
of it fit, at 32 bits a pixel (measured: 2048x1024 and 1920x1088 are taken, 2560x824 and 1920x1200 refused). A
larger size asked for keeps its shape and is made smaller; the page scales it up to fit."""
COLUMNS = 16
"""The width is a multiple of this: QEMU's VNC server keeps the screen in a surface whose width is rounded up to
16 pixels and turns a client's pointer into the tablet's position over that width, not the screen's, so on a
screen 1160 pixels wide the pointer lands 9 pixels left of the browser's at the right edge (measured, QEMU 10.0);
on a width that is a multiple of 16 both are the same and it lands where it points. (16 is also a multiple of the
8-pixel columns the VGA card shows.)"""
WHAT = "screen size"


def set_size(store: Store, name: str, width: int, height: int) -> tuple[int, int]:
    """Make the running capsule ``name``'s screen ``width`` x ``height`` (brought within :data:`MIN_SIZE` ..
    :data:`MAX_SIZE`, :data:`MAX_PIXELS` and what its X server allows, the width down to a multiple of
    :data:`COLUMNS`); the size set.
    InvalidName for a size that is not one, NotFound / Conflict as ``guestx.agent``, Conflict when the guest has
    no X session to resize."""
    if not (0 < width <= 16384 and 0 < height <= 16384):
        raise InvalidName(f"a screen of {width}x{height} pixels is not one to ask for: give a width and a height "
                          "of 1 to 16384")
    w = max(MIN_SIZE[0], min(width, MAX_SIZE[0]))
    h = max(MIN_SIZE[1], min(height, MAX_SIZE[1]))
    if w * h > MAX_PIXELS:
        shrink = math.sqrt(MAX_PIXELS / (w * h))
        w, h = max(MIN_SIZE[0], int(w * shrink)), max(MIN_SIZE[1], int(h * shrink))
    w = w // COLUMNS * COLUMNS
    with guestx.agent(store, name, WHAT) as agent:
        r = guestx.helper(agent, name, WHAT, "size", str(w), str(h))
    if r["exit_code"] != 0:
        raise guestx.failed(name, WHAT, r)
    try:
        got_w, got_h = (int(v) for v in r["stdout"].split())
    except ValueError:
        got_w = got_h = -1
    if not (0 < got_w <= MAX_SIZE[0] and 0 < got_h <= MAX_SIZE[1]):     # the guest's word: a size it may show
        raise guestx.failed(name, WHAT, r | {"stderr": f"the helper answered {r['stdout'][:80]!r}"})
    return got_w, got_h
