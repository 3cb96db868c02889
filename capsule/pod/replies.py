"""What a capsule's pod layer answers (``python3 -m pods …`` in the guest, through :mod:`capsule.pod.relay`),
checked before the host acts on it. The guest is not trusted: a field missing, of the wrong type, a path the
host did not ask about or a size over the cap is :class:`~capsule.runtime.guestagent.AgentReplyInvalid`,
raised before any file is made or any copy starts.

The cap on a pod image (:func:`image_cap`): CRIU's images of a pod are its memory pages — at most the
capsule's RAM resident, and as much again swapped out — plus the rest of its state (its tmpfs files, its
sockets' queues, CRIU's own records), for which 1 GiB is allowed. An image claiming more is refused, so a
guest can make the host hold at most twice its RAM plus 1 GiB for one checkpoint; and never more than the
store's file system has free (:func:`check_room`)."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsule.errors import StorageFull
from capsule.runtime.guestagent import AgentReplyInvalid, Reply
from pods.names import NAME_RX

OUTBOX = "/var/lib/pods/out"
POD_IMAGE_EXTRA = 1 << 30     # beyond the pages: tmpfs files, queues, CRIU's records
MAX_PODS = 4096               # the pods one capsule may list
MAX_SECONDS = 86400.0
STATE = re.compile(r"[a-z][a-z_-]{0,31}")


def image_cap(memory_mib: int) -> int:
    """The largest pod image a capsule of ``memory_mib`` MiB may claim (this module's description)."""
    return 2 * (memory_mib << 20) + POD_IMAGE_EXTRA


def check_room(store_dir: Path, size: int) -> None:
    """StorageFull unless the store's file system has ``size`` bytes free (before anything is written)."""
    st = os.statvfs(store_dir)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise StorageFull(f"the pod image is {size} bytes and the store has {free} bytes free; nothing was copied")


def _path_rx(pod: str) -> re.Pattern[str]:
    """Where ``pods checkpoint POD`` writes its image: ``OUTBOX/POD-<stamp>-<pid>.pod`` (``.tar.zst`` before
    format 2)."""
    return re.compile(re.escape(f"{OUTBOX}/{pod}-") + r"[0-9]{8}T[0-9]{6}-[0-9]{1,10}\.(?:pod|tar\.zst)")


def _address(r: Reply, key: str = "ip") -> str:
    ip = r.text(key, 64)
    try:
        ipaddress.IPv4Interface(ip)
    except ValueError:
        raise r.invalid(key, "an IPv4 address (A.B.C.D/N)") from None
    return ip


@dataclass(frozen=True)
class Dumped:
    """A checkpoint's image in the guest, as the host will copy it."""

    path: str
    size: int
    ip: str
    dump_seconds: float
    seconds: float
    steps: dict[str, float] = field(default_factory=dict)


STEP = re.compile(r"[a-z][a-z_]{0,15}")
MAX_STEPS = 16


def steps(r: Reply) -> dict[str, float]:
    """The guest's seconds per step (``steps``: where a checkpoint's or restore's time went), if it sent
    them: at most MAX_STEPS short names, each a number of seconds."""
    raw = r.value.get("steps", {})
    if not isinstance(raw, dict) or len(raw) > MAX_STEPS:
        raise r.invalid("steps", f"an object of at most {MAX_STEPS} steps")
    out = {}
    for name, took in raw.items():
        if not STEP.fullmatch(name) or isinstance(took, bool) or not isinstance(took, int | float) \
                or not 0 <= took <= MAX_SECONDS:
            raise r.invalid("steps", "step names (a-z, _) with their seconds")
        out[name] = float(took)
    return out


def image_path(result: object, capsule: str, pod: str) -> str:
    """The path of the image ``pods checkpoint POD`` made: only where that command writes POD's images."""
    return Reply(result, f"capsule {capsule!r}: pods checkpoint").text("path", 256, _path_rx(pod))


def dumped(result: object, capsule: str, pod: str, cap: int) -> Dumped:
    """``pods checkpoint POD``'s result, its size at most ``cap`` bytes."""
    r = Reply(result, f"capsule {capsule!r}: pods checkpoint")
    return Dumped(image_path(result, capsule, pod), r.integer("size", 0, cap), _address(r),
                  r.number("dump_seconds", hi=MAX_SECONDS), r.number("seconds", hi=MAX_SECONDS), steps(r))


MD5 = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Placed:
    """A checkpoint's image written onto the disk the host lent (``pods checkpoint POD --to DEVICE``): its
    size and MD5 there, and the id of the dump the guest keeps until the host has the image."""

    dump: str
    size: int
    md5: str
    ip: str
    dump_seconds: float
    seconds: float
    steps: dict[str, float] = field(default_factory=dict)


def dump_id(result: object, capsule: str, pod: str) -> str:
    """The id of the dump ``pods checkpoint POD --to`` kept: only one of POD's (``POD-<stamp>-<pid>``)."""
    rx = re.compile(re.escape(f"{pod}-") + r"[0-9]{8}T[0-9]{6}-[0-9]{1,10}")
    return Reply(result, f"capsule {capsule!r}: pods checkpoint").text("dump", 64, rx)


def placed(result: object, capsule: str, pod: str, cap: int) -> Placed:
    """``pods checkpoint POD --to DEVICE``'s result, its size at most ``cap`` bytes."""
    r = Reply(result, f"capsule {capsule!r}: pods checkpoint")
    return Placed(dump_id(result, capsule, pod), int(r.integer("size", 1, cap)), r.text("md5", 32, MD5), _address(r),
                  r.number("dump_seconds", hi=MAX_SECONDS), r.number("seconds", hi=MAX_SECONDS), steps(r))


def described(result: object, capsule: str, verb: str) -> dict[str, Any]:
    """A pod as the pod layer describes it (``ls``'s items, ``restore``'s result): a name, an address and a
    state, checked; the other fields are passed on as they are."""
    r = Reply(result, f"capsule {capsule!r}: pods {verb}")
    r.text("name", 31, NAME_RX)
    _address(r)
    r.text("state", 32, STATE)
    return r.value


def listed(result: object, capsule: str) -> list[dict[str, Any]]:
    """``pods ls``'s result: a list of pods, each :func:`described`."""
    if not isinstance(result, list) or len(result) > MAX_PODS:
        raise AgentReplyInvalid(f"capsule {capsule!r}: pods ls: the guest should answer a list of at most "
                                f"{MAX_PODS} pods, not {type(result).__name__}"
                                + (f" of {len(result)}" if isinstance(result, list) else ""))
    return [described(p, capsule, "ls") for p in result]


def restored(result: object, capsule: str) -> dict[str, Any]:
    """``pods restore``'s result: the pod :func:`described`, and the seconds it took."""
    out = described(result, capsule, "restore")
    r = Reply(out, f"capsule {capsule!r}: pods restore")
    r.number("seconds", hi=MAX_SECONDS)
    if "steps" in out:
        out["steps"] = steps(r)
    return out


def tagged(capsule: str, result: object, verb: str) -> dict[str, Any]:
    """``{"capsule": CAPSULE, **result}`` for a verb whose result is passed on: an object, whose own
    ``capsule`` field (if the guest sent one) does not replace ours."""
    value = Reply(result, f"capsule {capsule!r}: pods {verb}").value
    return {"capsule": capsule, **{k: v for k, v in value.items() if k != "capsule"}}
