"""Where a running capsule's pointer is on its screen, as the guest's X server says (XQueryPointer, run by the X
helper through Capsule's guest agent: ``guestx``): what a console's pointer is checked against, since the screen's
virtio tablet turns the console's position into the guest's."""

from __future__ import annotations

from capsule.console import guestx
from capsule.store import Store

WHAT = "pointer"


def position(store: Store, name: str) -> tuple[int, int]:
    """The running capsule ``name``'s pointer, (x, y) in pixels of its X screen. NotFound for an unknown capsule,
    Conflict when it is not running or has no X session, GuestAgent errors (503/502) when its agent does not
    answer."""
    with guestx.agent(store, name, WHAT) as agent:
        r = guestx.helper(agent, name, WHAT, "pointer")
    if r["exit_code"] != 0:
        raise guestx.failed(name, WHAT, r)
    try:
        x, y = (int(v) for v in r["stdout"].split())
    except ValueError:
        raise guestx.failed(name, WHAT, r | {"stderr": f"the helper answered {r['stdout'][:80]!r}"}) from None
    return x, y
