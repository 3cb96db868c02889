"""A peer's capsule's clipboard and screen size, through this host: the console panel's clipboard box, and its
screen following the panel's size, on a console relayed from a peer (``relay.py``), such as a capsule's that moved
there from the page and whose console followed it. The page signs in here only; this host asks the peer's own
routes (``GET``/``PUT /api/capsules/{name}/clipboard``, ``clipboard.py`` there; ``PUT …/screen-size``,
``screensize.py``) with its token for the peer (the peers table's, as the console relay and Bring here do), so the
peer's rules and limits decide. A text over :data:`clipboard.MAX_BYTES` is refused here, before the peer is
asked."""

from __future__ import annotations

from typing import Any

from capsule import hosts
from capsule.console import clipboard, screensize
from capsule.errors import TransferFailed
from capsule.names import check_name
from capsule.store import Store

ASK_TIMEOUT = 60.0
"""Seconds for the peer's answer: it runs the X helper in the guest, a few guest-agent calls of up to 20 s each."""


def _fields(peer: hosts.Peer, answer: Any, want: dict[str, type]) -> dict[str, Any]:
    """The peer's answer, holding ``want``'s fields of their types (TransferFailed otherwise)."""
    if not isinstance(answer, dict) or any(type(answer.get(k)) is not t for k, t in want.items()):
        raise TransferFailed(f"host {peer.name} answered a console call with something else: {str(answer)[:200]}")
    return {k: answer[k] for k in want}


def get(store: Store, host: str, name: str) -> dict[str, Any]:
    """Peer ``host``'s capsule ``name``'s clipboard, as the peer answers it: ``text``, ``bytes`` (of UTF-8),
    ``max_bytes`` (its limit). NotFound for an unknown host; the peer's own errors (NotFound, Conflict,
    RequestTooLarge, ...) as it raised them; Unreachable when it does not answer."""
    check_name(name)
    peer = hosts.get(store, host)
    with hosts.client(peer, ASK_TIMEOUT) as client:
        answer = client.get_json(f"/api/capsules/{name}/clipboard")
    return _fields(peer, answer, {"text": str, "bytes": int, "max_bytes": int})


def set(store: Store, host: str, name: str, text: str) -> dict[str, Any]:
    """Make ``text`` peer ``host``'s capsule ``name``'s clipboard: ``bytes`` set and ``max_bytes``, as the peer
    answers. A text over :data:`clipboard.MAX_BYTES` is refused (RequestTooLarge) before the peer is asked; other
    errors as :func:`get`."""
    check_name(name)
    size = len(text.encode("utf-8", errors="replace"))
    if size > clipboard.MAX_BYTES:
        raise clipboard.too_large(size, "the text")
    peer = hosts.get(store, host)
    with hosts.client(peer, ASK_TIMEOUT) as client:
        answer = client.request("PUT", f"/api/capsules/{name}/clipboard", json_body={"text": text},
                                idempotent=False).json()
    return _fields(peer, answer, {"bytes": int, "max_bytes": int})


def set_size(store: Store, host: str, name: str, width: int, height: int) -> tuple[int, int]:
    """Make peer ``host``'s capsule ``name``'s screen ``width`` x ``height``; the size the peer set (it bounds and
    rounds it as :func:`capsule.console.screensize.set_size` does). Errors as :func:`get`."""
    check_name(name)
    peer = hosts.get(store, host)
    with hosts.client(peer, ASK_TIMEOUT) as client:
        answer = client.request("PUT", f"/api/capsules/{name}/screen-size",
                                json_body={"width": width, "height": height}, idempotent=True).json()
    got = _fields(peer, answer, {"width": int, "height": int})
    if not (0 < got["width"] <= screensize.MAX_SIZE[0] and 0 < got["height"] <= screensize.MAX_SIZE[1]):
        raise TransferFailed(f"host {peer.name} answered a screen size of {got['width']}x{got['height']}, "
                             f"outside 1x1 to {screensize.MAX_SIZE[0]}x{screensize.MAX_SIZE[1]}")
    return got["width"], got["height"]
