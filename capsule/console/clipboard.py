"""A running capsule's clipboard, both ways, through Capsule's own guest agent (the virtio-serial channel every
capsule has): :func:`get` reads the guest's X clipboard, :func:`set` makes a text the guest's clipboard.

The guest side is the X helper (``xsession.py``, its selections), run through the agent (``guestx``): nothing is
installed in the guest, and nothing is added to the machine: QEMU's own clipboard path
(the ``qemu-vdagent`` chardev) carries a migration blocker, so a capsule with it could no longer move. The
selection lives in a guest process, so it moves with the capsule (live, or in a memory image).

A text is at most :data:`MAX_BYTES` bytes of UTF-8, both ways; beyond that :class:`RequestTooLarge`, and nothing
changes in the guest."""

from __future__ import annotations

import base64
import binascii
import secrets

from capsule.console import guestx
from capsule.errors import Conflict, RequestTooLarge
from capsule.store import Store

MAX_BYTES = 512 * 1024
"""The largest clipboard text, in bytes of UTF-8, either way: well below the agent's request body bound (1 MiB by
default), so the clipboard's own error is the one a caller sees."""

INBOX = "/run/capsule-clipboard"     # root's, in the guest: where a text being set is written first
CHUNK = 48 * 1024                    # base64 characters an exec carries (the agent's request line: 64 KiB)
WHAT = "clipboard"


def too_large(size: int | None, where: str) -> RequestTooLarge:
    """The error of a text (``where``: whose) over :data:`MAX_BYTES`, with its size if known."""
    got = "" if size is None else f" ({size} bytes)"
    return RequestTooLarge(f"{where}{got} is larger than the clipboard's limit of {MAX_BYTES // 1024} KiB: "
                           "copy a smaller part")


def get(store: Store, name: str) -> str:
    """The running capsule ``name``'s clipboard text (empty when nothing in the guest owns one). NotFound for an
    unknown capsule, Conflict when it is not running or has no X session, RequestTooLarge over
    :data:`MAX_BYTES`, GuestAgent errors (503/502) when its agent does not answer."""
    with guestx.agent(store, name, WHAT) as agent:
        r = guestx.helper(agent, name, WHAT, "get", str(MAX_BYTES), max_output=4 * (MAX_BYTES // 3 + 1) + 64)
    if r["exit_code"] == guestx.TOO_LARGE:
        raise too_large(None, f"capsule {name!r}'s clipboard")
    if r["exit_code"] != 0:
        raise guestx.failed(name, WHAT, r)
    try:
        data = base64.b64decode(r["stdout"].strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise Conflict(f"capsule {name!r}: the clipboard helper answered something other than base64") from exc
    if len(data) > MAX_BYTES:
        raise too_large(len(data), f"capsule {name!r}'s clipboard")
    return data.decode("utf-8", errors="replace")


def set(store: Store, name: str, text: str) -> int:
    """Make ``text`` the running capsule ``name``'s clipboard (CLIPBOARD and PRIMARY: a terminal pastes it with
    its middle button or Shift+Insert); the number of bytes set. Errors as :func:`get`; a text over
    :data:`MAX_BYTES` is refused before anything reaches the guest."""
    data = text.encode("utf-8", errors="replace")
    if len(data) > MAX_BYTES:
        raise too_large(len(data), "the text")
    encoded = base64.b64encode(data).decode()
    inbox = f"{INBOX}/{secrets.token_hex(8)}"
    with guestx.agent(store, name, WHAT) as agent:
        for i in range(0, max(len(encoded), 1), CHUNK):
            write = "umask 077 && mkdir -p " + INBOX + " && cat > " if i == 0 else "cat >> "
            r = guestx.run(agent, name, WHAT, ["sh", "-c", write + inbox], stdin=encoded[i:i + CHUNK])
            if r["exit_code"] != 0:
                raise guestx.failed(name, WHAT, r)
        r = guestx.helper(agent, name, WHAT, "set", inbox)
        if r["exit_code"] != 0:
            guestx.run(agent, name, WHAT, ["rm", "-f", inbox])
            raise guestx.failed(name, WHAT, r)
    return len(data)
