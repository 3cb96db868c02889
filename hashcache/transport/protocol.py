"""Which protocol two peers speak, and whether they can talk.

Every client names its release and protocol in its ``User-Agent`` (``capsule/0.2.0 protocol/2``: a few bytes,
which count on a slow link); every agent answers with ``X-Capsule-Protocol: 2 capsule/0.2.0``. A release
speaks its own protocol and the one before (:data:`OLDEST`), so an agent talks to the previous release and a
client to the previous release's agents. A peer that names no protocol is the release before versions were
named (0.1.0: ``User-Agent: capsule``, no answer header): protocol 1. A peer older than :data:`OLDEST` is
refused with :class:`~hashcache.errors.ProtocolMismatch`, whose message names both sides' releases and
protocols; a newer peer decides for itself (it speaks ours too, or refuses us).

What an agent serves beyond its protocol is named in :data:`FEATURES` on every answer (``X-Capsule-Features:
tunnel``): a call that needs a feature a peer lacks is refused with :func:`require`'s message, which names both
sides, rather than with the bare 404 of a route the older agent does not have. A feature is added without a
new protocol number: nothing the older peers do changes."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hashcache.errors import ProtocolMismatch

PROTOCOL = 2        # 2: grants name their capability (POST /v1/grants/host takes "allow"); numbers are bounded
OLDEST = 1          # the protocol of the release before: still spoken
HEADER = "X-Capsule-Protocol"
FEATURES = "X-Capsule-Features"
FIRST = "0.1.0 or earlier"   # what a peer that names no protocol is

_UA = re.compile(r"capsule(?:-[a-z]+)?(?:/(?P<release>[0-9A-Za-z.+-]{1,32}))?(?: protocol/(?P<protocol>[0-9]{1,6}))?")
_ANSWER = re.compile(r"(?P<protocol>[0-9]{1,6}) capsule/(?P<release>[0-9A-Za-z.+-]{1,32})")


@dataclass(frozen=True)
class Peer:
    release: str
    protocol: int

    def __str__(self) -> str:
        return f"capsule {self.release} (protocol {self.protocol})"


def user_agent(release: str | None = None, part: str = "capsule") -> str:
    """What a client of ``release`` (None: a part that does not know it, e.g. the disk server) sends."""
    return f"{part}/{release} protocol/{PROTOCOL}" if release else f"{part} protocol/{PROTOCOL}"


def answer(release: str) -> str:
    """The value of :data:`HEADER` an agent of ``release`` answers with."""
    return f"{PROTOCOL} capsule/{release}"


def of_client(user_agent_value: str | None) -> Peer | None:
    """The peer a request's ``User-Agent`` names; None for a client that is not Capsule (a browser, curl)."""
    m = _UA.fullmatch((user_agent_value or "").strip())
    if m is None:
        return None
    if m["protocol"] is None:
        return Peer(FIRST, 1)
    return Peer(m["release"] or "(release not named)", int(m["protocol"]))


def of_agent(header_value: str | None) -> Peer:
    """The agent an answer's :data:`HEADER` names (none: an agent of 0.1.0 or earlier)."""
    m = _ANSWER.fullmatch((header_value or "").strip())
    if m is None:
        return Peer(FIRST, 1)
    return Peer(m["release"], int(m["protocol"]))


def check(peer: Peer, release: str, where: str) -> Peer:
    """Refuse ``peer`` if it is older than the oldest protocol ``release`` speaks."""
    if peer.protocol < OLDEST:
        raise ProtocolMismatch(
            f"{where} is {peer}; this is capsule {release} (protocol {PROTOCOL}), which speaks protocols "
            f"{OLDEST} to {PROTOCOL}: upgrade Capsule there")
    return peer


def features_of(header_value: str | None) -> frozenset[str]:
    """The features an answer's :data:`FEATURES` header names (none: an agent that names none)."""
    return frozenset(f.strip() for f in (header_value or "").split(",")[:32] if 0 < len(f.strip()) <= 32)


def require(peer: Peer | None, features: frozenset[str], feature: str, release: str, where: str, what: str) -> None:
    """Refuse (:class:`ProtocolMismatch`) to go on with a peer whose answer did not name ``feature``: ``what``
    says what needs it, and the message names both sides' releases and protocols."""
    if feature in features:
        return
    theirs = str(peer) if peer is not None else f"capsule {FIRST} (protocol 1)"
    raise ProtocolMismatch(f"{where} is {theirs}, which has no {feature} ({what} needs it); this is capsule "
                           f"{release} (protocol {PROTOCOL}): upgrade Capsule there")
