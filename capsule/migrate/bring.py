"""Bring a peer's capsule here: a migration to this host started from this host, i.e. this host asks the peer's
agent to migrate the capsule to it (the peer's own ``POST /api/capsules/{name}/migrate``, live by default),
then follows and cancels that migration through the peer's API.

The peer moves the capsule to *this* host as the peer knows it: its peers table's name for a host with this
store's id (``capsule host ls`` there). When it has none, nothing is started and the refusal names what to add
(``capsule host add`` on the peer). Every call to the peer carries this host's credential for it (the peers
table's token, as the console relay does); the peer's own rules decide what that token may do (a token with
only the ``host`` scope cannot start a migration there)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx

from capsule import hosts
from capsule.errors import AuthFailed, Conflict, NotFound, TransferFailed, Unreachable
from capsule.names import check_name
from capsule.store import Store
from hashcache.errors import from_wire
from hashcache.transport import plain, tls

ASK_TIMEOUT = 10.0          # seconds for a call to the peer (its /api/hosts asks its own peers: 3 s each)
STREAM_IDLE = 60.0          # seconds without a byte on the peer's event stream (it sends a comment every 15 s)
UNKNOWN = "unknown_destination"


def name_here(store: Store, peer: hosts.Peer) -> str | None:
    """The peer's name for this host (a row of its peers table with this store's id), or None."""
    with hosts.client(peer, ASK_TIMEOUT) as client:
        rows = client.request("GET", "/api/hosts", idempotent=False).json()
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and row.get("store_id") == store.id and isinstance(row.get("name"), str):
            return str(row["name"])
    return None


def _unknown(peer: hosts.Peer, store: Store) -> str:
    return (f"host {peer.name} does not know this host (store {store.id[:12]}), so it cannot move a capsule "
            f"here: on {peer.name}, run `capsule host add NAME URL --token-file FILE` with this host's agent URL "
            "and a token of this host; nothing was changed")


def check(store: Store, host: str, name: str) -> dict[str, Any]:
    """Whether ``name`` on peer ``host`` may be brought here: ``refused`` (why not at all, or None), ``to`` (the
    peer's name for this host) and ``live_refusals`` (why a live move would be refused: the peer's pre-check)."""
    check_name(name)
    peer = hosts.get(store, host)
    to = name_here(store, peer)
    out: dict[str, Any] = {"capsule": name, "host": peer.name, "to": to, "refused": None, "live_refusals": []}
    if to is None:
        return out | {"refused": {"reason": UNKNOWN, "detail": _unknown(peer, store)}}
    with hosts.client(peer, ASK_TIMEOUT) as client:
        answer = client.get_json(f"/api/capsules/{name}/migrate/check", to=to)
    return out | {"live_refusals": list(answer.get("refusals") or []) if isinstance(answer, dict) else []}


def bring(store: Store, host: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """Have peer ``host`` migrate its capsule ``name`` here (``body``: the migrate call's fields but ``to``);
    the peer's migration as it answered (``capsule.agent.migrations.MigrationOut``) with ``host`` added."""
    check_name(name)
    peer = hosts.get(store, host)
    to = name_here(store, peer)
    if to is None:
        raise Conflict(_unknown(peer, store))
    with hosts.client(peer, ASK_TIMEOUT) as client:
        answer = client.request("POST", f"/api/capsules/{name}/migrate", json_body=body | {"to": to},
                                idempotent=False).json()
    return dict(answer) | {"host": peer.name}


def migration(store: Store, host: str, mid: str) -> dict[str, Any]:
    """A migration of peer ``host`` (its last progress snapshot, how it ended)."""
    peer = hosts.get(store, host)
    with hosts.client(peer, ASK_TIMEOUT) as client:
        return dict(client.get_json(f"/api/migrations/{_mid(mid)}")) | {"host": peer.name}


def cancel(store: Store, host: str, mid: str) -> dict[str, Any]:
    """Cancel a migration of peer ``host``: the capsule runs there again (the peer refuses once it is too late)."""
    peer = hosts.get(store, host)
    with hosts.client(peer, ASK_TIMEOUT) as client:
        answer = client.request("POST", f"/api/migrations/{_mid(mid)}/cancel", idempotent=False).json()
    return dict(answer) | {"host": peer.name}


async def events(store: Store, host: str, mid: str) -> AsyncIterator[bytes]:
    """The peer's event stream of a migration (Server-Sent Events), as the peer sends it; the peer's refusal
    (e.g. no such migration) is raised before the first byte."""
    peer = hosts.get(store, host)
    plain.check(peer.url)       # this host's token for the peer never crosses a network in clear
    verify: Any = tls.client_context(peer.fingerprint) if peer.url.startswith("https://") else True
    client = httpx.AsyncClient(verify=verify, timeout=httpx.Timeout(ASK_TIMEOUT, read=STREAM_IDLE))
    try:
        request = client.build_request("GET", f"{peer.url}/api/migrations/{_mid(mid)}/events",
                                       headers={"Authorization": f"Bearer {peer.token}"})
        reply = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        await client.aclose()
        raise Unreachable(f"host {peer.name} does not answer for its migration ({type(exc).__name__}: {exc})") \
            from exc
    if reply.status_code >= 400:
        body = await reply.aread()
        await reply.aclose()
        await client.aclose()
        try:
            wire: Any = httpx.Response(reply.status_code, content=body).json()
        except ValueError:
            wire = {"detail": body[:200].decode(errors="replace")}
        refusal = from_wire(wire, reply.status_code, f"host {peer.name}: ")
        if isinstance(refusal, AuthFailed):     # this host's token, not the page's sign-in (as in hosts.client)
            raise TransferFailed(f"host {peer.name} refuses this host's token for it ({refusal})") from refusal
        raise refusal

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in reply.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            return      # the page's EventSource asks again, or fetches the migration
        finally:
            await reply.aclose()
            await client.aclose()

    return relay()


def _mid(mid: str) -> str:
    if not (isinstance(mid, str) and 0 < len(mid) <= 64 and mid.isalnum()):
        raise NotFound(f"no migration {str(mid)[:40]!r}")
    return mid
