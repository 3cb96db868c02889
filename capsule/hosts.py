"""The peers a host knows (``capsule host add NAME URL``): other hosts' agents, each with its token, the
store id it answered with when it was added, and the fingerprint of its TLS certificate, pinned the way ssh
pins host keys (a changed one is refused: :mod:`hashcache.transport.tls`). Kept in the catalogue, in a
table of its own. :func:`pin_for` is how every client of a URL finds the pin of the known host there.

Asking peers is concurrent and bounded by one deadline: a peer that does not answer in time is marked
unreachable and the others are still reported."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from capsule.agentclient import AgentClient
from capsule.errors import (
    AlreadyExists,
    AuthFailed,
    Conflict,
    Error,
    InvalidName,
    NotFound,
    TransferFailed,
    Unreachable,
)
from capsule.names import check_name
from capsule.store import Store
from hashcache.errors import HostKeyError
from hashcache.transport import tls

ADD_TIMEOUT = 10.0
ASK_TIMEOUT = 3.0
_STORE_ID_RE = re.compile(r"^[0-9a-f]{8,64}$")


@dataclass(frozen=True)
class Peer:
    name: str
    url: str
    store_id: str
    added: float
    token: str = field(repr=False)
    fingerprint: str | None = None  # the pinned certificate (None: http://, or a CA-signed certificate)

    def as_dict(self) -> dict[str, Any]:
        """Everything but the token."""
        return {"name": self.name, "url": self.url, "store_id": self.store_id, "added": self.added,
                "fingerprint": self.fingerprint}


@dataclass
class PeerStatus:
    peer: Peer
    reachable: bool
    error: str | None = None
    answer: Any = None          # what the peer answered (see ask_all)
    seconds: float = 0.0
    error_code: str | None = None  # the wire code of the error (e.g. "auth_failed", "unreachable")

    def as_dict(self) -> dict[str, Any]:
        return self.peer.as_dict() | {"reachable": self.reachable, "error": self.error,
                                      "seconds": round(self.seconds, 3)}


def check_url(url: str) -> str:
    """An agent's base URL: http(s)://HOST[:PORT], nothing else (no user, path, query or fragment)."""
    if not isinstance(url, str) or len(url) > 300 or any(c.isspace() or ord(c) < 32 for c in url):
        raise InvalidName(f"invalid agent URL {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidName(f"invalid agent URL {url!r}: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidName(f"invalid agent URL {url!r}: expected http://HOST:PORT or https://HOST:PORT")
    if parts.username or parts.password or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidName(f"invalid agent URL {url!r}: give only scheme, host and port (the token is given "
                          "with --token-file)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


def _info(url: str, token: str, timeout: float, fingerprint: str | None = None) -> dict[str, Any]:
    with AgentClient(url, token, timeout=timeout, fingerprint=fingerprint) as client:
        info = client.request("GET", "/v1/info", idempotent=False).json()
    if not isinstance(info, dict) or not isinstance(info.get("store_id"), str) \
            or not _STORE_ID_RE.match(info["store_id"]):
        raise TransferFailed(f"the agent at {url} answered /v1/info without a valid store id")
    return info


def _row(r: Any) -> Peer:
    return Peer(name=r["name"], url=r["url"], store_id=r["store_id"], added=r["added"], token=r["token"],
                fingerprint=r["fingerprint"])


def peers(store: Store) -> list[Peer]:
    """The known peers, by name (no network)."""
    return [_row(r) for r in store.catalogue.query("SELECT * FROM peers ORDER BY name")]


def get(store: Store, name: str) -> Peer:
    check_name(name, "host")
    rows = store.catalogue.query("SELECT * FROM peers WHERE name=?", (name,))
    if not rows:
        raise NotFound(f"no host named {name!r} (see `capsule host ls`)")
    return _row(rows[0])


def pin_for(store: Store, url: str, fingerprint: str | None = None) -> str | None:
    """The certificate fingerprint a client of ``url`` pins: ``fingerprint`` when given (``--fingerprint``),
    else that of the known host at that URL, else None (http://, or the system's CA validation)."""
    if fingerprint:
        return tls.parse_fingerprint(fingerprint)
    if not url.startswith("https://"):
        return None  # plain HTTP has nothing to pin
    try:
        url = check_url(url)
    except InvalidName:
        return None
    rows = store.catalogue.query("SELECT fingerprint FROM peers WHERE url=?", (url,))
    return rows[0]["fingerprint"] if rows else None


@dataclass(frozen=True)
class Certificate:
    """What ``host add`` learnt of a peer's certificate before trusting it."""

    fingerprint: str
    ca_signed: bool


def _trust(url: str, fingerprint: str | None, confirm: Callable[[Certificate], bool] | None,
           timeout: float) -> str | None:
    """The pin for a new host at ``url``: the certificate it presents must have ``fingerprint`` if one is
    given; else a CA-signed one is trusted by CA validation (no pin), and a self-signed one on first use
    only if ``confirm`` is given and accepts its fingerprint."""
    if not url.startswith("https://"):
        if fingerprint:
            raise InvalidName(f"{url} is plain HTTP: it has no certificate to pin (use https://)")
        return None
    try:
        seen, ca_signed = tls.peer_certificate(url, timeout)
    except OSError as exc:
        raise Unreachable(f"cannot reach the agent at {url}: {exc}", refused=isinstance(exc, ConnectionRefusedError)) \
            from exc
    if fingerprint:
        want = tls.parse_fingerprint(fingerprint)
        if seen != want:
            raise tls.explain(url, tls.PinMismatch(want, seen))
        return want
    if confirm is None:
        if ca_signed:
            return None
        raise HostKeyError(f"the agent at {url} presents a self-signed certificate, {seen}: check it against "
                           "the fingerprint `capsule serve` printed on that host, then pass it with --fingerprint "
                           "(or use `capsule host add`, which asks)")
    if not confirm(Certificate(seen, ca_signed)):
        raise HostKeyError(f"the certificate {seen} of {url} was not accepted; nothing was added")
    return None if ca_signed else seen


def add(store: Store, name: str, url: str, token: str, *, timeout: float = ADD_TIMEOUT,
        fingerprint: str | None = None, confirm: Callable[[Certificate], bool] | None = None) -> Peer:
    """Know the agent at ``url`` as ``name``: it must answer ``/v1/info`` with ``token`` (its store id is
    recorded), and be neither this host nor a host already known. Over https its certificate is pinned:
    it must have ``fingerprint`` if given; else ``confirm`` sees it first (trust on first use; the CLI
    asks the user), and without ``confirm`` a self-signed certificate is refused. A CA-signed certificate
    is left to CA validation unless a fingerprint is given."""
    check_name(name, "host")
    url = check_url(url)
    if not token or len(token) < 16 or any(c.isspace() for c in token):
        raise InvalidName("the peer's token must be at least 16 characters with no spaces "
                          "(the contents of its agent's token file)")
    known = peers(store)
    if any(p.name == name for p in known):
        raise AlreadyExists(f"a host named {name!r} is already known (`capsule host rm {name}` first)")
    if same := next((p for p in known if p.url == url), None):
        raise AlreadyExists(f"{url} is already known as host {same.name!r}")
    pin = _trust(url, fingerprint, confirm, timeout)
    info = _info(url, token, timeout, pin)
    if info["store_id"] == store.id:
        raise Conflict(f"{url} is this host's own agent (store {store.id})")
    if same := next((p for p in known if p.store_id == info["store_id"]), None):
        raise AlreadyExists(f"{url} serves store {info['store_id']}, already known as host {same.name!r}")
    peer = Peer(name, url, info["store_id"], time.time(), token, pin)
    cat = store.catalogue
    with store.lock(), cat.transaction():
        if cat.query("SELECT 1 FROM peers WHERE name=? OR url=?", (name, url)):
            raise AlreadyExists(f"a host named {name!r} or at {url} was added meanwhile")
        cat.query("INSERT INTO peers(name, url, token, store_id, added, fingerprint) VALUES(?,?,?,?,?,?)",
                  (peer.name, peer.url, peer.token, peer.store_id, peer.added, peer.fingerprint))
    return peer


def remove(store: Store, name: str) -> Peer:
    """Forget a peer. Layers demand-paged from it keep their own record of its URL and token."""
    peer = get(store, name)
    cat = store.catalogue
    with store.lock(), cat.transaction():
        cat.query("DELETE FROM peers WHERE name=?", (name,))
    return peer


def name_for_url(known: list[Peer]) -> Callable[[str], str | None]:
    """A lookup from an agent URL to the name of the peer at that URL (None if it is none of them)."""
    by_url = {p.url: p.name for p in known}

    def lookup(url: str) -> str | None:
        try:
            return by_url.get(check_url(url))
        except InvalidName:
            return None

    return lookup


@contextmanager
def client(peer: Peer, timeout: float) -> Iterator[AgentClient]:
    """A client of ``peer`` with this host's token for it (*Bring here*, a peer's clipboard). The peer refusing that
    token is no sign-in matter of the page's (a 401 here would end its session): it becomes a TransferFailed (502)
    naming the host and what to do."""
    try:
        with AgentClient(peer.url, peer.token, timeout=timeout, fingerprint=peer.fingerprint) as c:
            yield c
    except AuthFailed as exc:
        raise TransferFailed(f"host {peer.name} refuses this host's token for it ({exc}): give it a valid one "
                             f"(`capsule host rm {peer.name}`, then `capsule host add` again)") from exc


def ask_one(store: Store, name: str, path: str, *, timeout: float = ASK_TIMEOUT) -> Any:
    """GET ``path`` from the known host ``name`` (its answer), within ``timeout`` seconds: :class:`NotFound` for an
    unknown host; a peer that refuses or does not answer raises :class:`TransferFailed` naming it and why."""
    peer = get(store, name)
    (status,) = ask_all(store, path, timeout=timeout, only=[peer.name])
    if not status.reachable:
        raise TransferFailed(f"host {peer.name}: {status.error}")
    return status.answer


def ask_all(store: Store, path: str = "/v1/info", *, timeout: float = ASK_TIMEOUT,
            only: Collection[str] | None = None) -> list[PeerStatus]:
    """GET ``path`` from every peer (or those named in ``only``) at once, all within ``timeout`` seconds.
    A peer that refuses, fails, answers as another store (for ``/v1/info``) or is still silent at the
    deadline is unreachable, with the reason; its call is abandoned (its thread ends at the client's own
    timeout)."""
    known = [p for p in peers(store) if only is None or p.name in only]
    if not known:
        return []
    started = time.monotonic()

    def one(peer: Peer) -> Any:
        with AgentClient(peer.url, peer.token, timeout=timeout, fingerprint=peer.fingerprint) as client:
            answer = client.request("GET", path, idempotent=False).json()
        if path == "/v1/info" and (not isinstance(answer, dict) or answer.get("store_id") != peer.store_id):
            raise TransferFailed(f"{peer.url} now answers as another store, not {peer.store_id}: "
                                 f"`capsule host rm {peer.name}` and add it again if that is intended")
        return answer

    pool = ThreadPoolExecutor(max_workers=min(16, len(known)), thread_name_prefix="capsule-peer")
    try:
        futures = {pool.submit(one, p): p for p in known}
        wait(futures, timeout=timeout)
        out = []
        for fut, peer in futures.items():
            seconds = time.monotonic() - started
            if not fut.done():
                fut.cancel()
                out.append(PeerStatus(peer, False, f"no answer within {timeout:g}s", seconds=seconds,
                                      error_code="unreachable"))
                continue
            try:
                out.append(PeerStatus(peer, True, answer=fut.result(), seconds=seconds))
            except (Error, ValueError) as exc:
                reason = str(exc) if isinstance(exc, Error) else f"malformed answer: {exc}"
                code = exc.code if isinstance(exc, Error) else "peer_error"
                out.append(PeerStatus(peer, False, reason, seconds=seconds, error_code=code))
            except Exception as exc:  # noqa: BLE001 - one peer's failure never hides the others
                out.append(PeerStatus(peer, False, f"{type(exc).__name__}: {exc}", seconds=seconds,
                                      error_code="unreachable"))
        return out
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
