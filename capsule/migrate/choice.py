"""Which kind of move a request asks for: live (the guest keeps running, pauses under a second), or offline
(suspended here first) in ``full`` or ``demand`` mode. One rule for the command line and the dashboard's API,
so that naming a mode never silently does something else:

- nothing named: live;
- a mode (``full``, ``demand``) or ballooning named, or live turned off (``--offline``, ``live: false``):
  offline, in the mode named (``full`` when none is);
- live asked for explicitly (``live: true``) with a mode or ballooning: refused, naming the conflict;
- post-copy asked for on an offline move: refused (post-copy is a way of ending a live move)."""

from __future__ import annotations

from dataclasses import dataclass

from capsule.errors import InvalidName

MODES = ("full", "demand")


@dataclass(frozen=True)
class Choice:
    live: bool
    mode: str                 # "live", or the offline mode: "full" | "demand"


def choose(live: bool | None, mode: str | None, balloon: bool, postcopy: bool = False, *,
           names: dict[str, str] | None = None) -> Choice:
    """The move asked for (see the module's text). ``names``: how the caller spells ``live``, ``offline``,
    ``mode``, ``balloon`` and ``postcopy`` (the CLI's options, the API's fields), for the error."""
    n = {"live": "live: true", "offline": "live: false", "mode": "mode", "balloon": "balloon",
         "postcopy": "postcopy"} | (names or {})
    if mode is not None and mode not in MODES:
        raise InvalidName(f"unknown migration mode {mode!r}: choose full or demand (both offline), or name no "
                          "mode for a live move")
    offline_asked = [n[k] for k, v in (("mode", mode is not None), ("balloon", balloon)) if v]
    if live is True and offline_asked:
        raise InvalidName(f"{n['live']} conflicts with {' and '.join(offline_asked)}: a live move has no mode and "
                          f"no ballooning (they are for offline moves); leave out {n['live']} to move it offline, "
                          f"or {' and '.join(offline_asked)} to move it live; nothing was changed")
    is_live = live is True or (live is None and not offline_asked)
    if postcopy and not is_live:
        why = n["offline"] if live is False else " and ".join(offline_asked)
        raise InvalidName(f"{n['postcopy']} is for live moves, and {why} makes this one offline: leave out "
                          f"{n['postcopy']}, or move it live; nothing was changed")
    return Choice(True, "live") if is_live else Choice(False, mode or "full")


__all__ = ["MODES", "Choice", "choose"]
