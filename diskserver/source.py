"""The disk server's HCP client: READ blocks of one layer from its source host's agent.

Only the one call demand paging needs (§4.3, §4.4.3), READ, over the one agent transport
(:mod:`hashcache.transport`): the agent's block stream (a pool of WebSockets) or, from an agent
without one, HTTP::

    POST {url}/v1/objects/layer/{id}/read?level=L&compress=true|false
         Authorization: Bearer TOKEN
         body = encode_indices(ascending block indices)   → the blocks, concatenated (zstd unless compress=false)

Transient failures (connection refused or reset, timeouts, HTTP 5xx/429) are retried with exponential
back-off until ``retry_seconds`` have passed since the first attempt; then :class:`SourceUnavailable`
is raised. Over https the source's certificate is pinned to ``fingerprint`` (both the stream and HTTP:
:mod:`hashcache.transport.tls`); a different one is a :class:`SourceError` at once, never retried. A
refusal (HTTP 4xx) or a malformed answer raises :class:`SourceError` at once. A 401 is
tried once more only if the token file changed (a rotated token). The client does not check block
content: the caller verifies every block against its manifest hash.

A layer's source may also be something other than an agent (:func:`open_source`): a remote spec with an
``opener`` names the function that makes it, any object with :class:`BlockSource`'s shape; the chain treats
it exactly as an agent (batches, verification against the manifest, the hash cache, counters).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from diskserver.errors import SourceError, SourceUnavailable
from hashcache.errors import AuthFailed, HashcacheError, HostKeyError, Unreachable
from hashcache.hcp import MAX_BATCH, unpack_blocks
from hashcache.transport import HttpTransport, Retrying, RetryPolicy, StreamTransport, Transport, protocol, read_call
from hashcache.transport.base import TokenSource, error_of
from hashcache.transport.wrappers import Reauthenticating

if TYPE_CHECKING:
    from diskserver.chain.spec import RemoteSpec, RetrySpec

_TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504, 507})


@dataclass(frozen=True)
class ReadResult:
    blocks: list[bytes]
    wire_bytes: int  # request + response bytes, headers included (approximately)
    attempts: int


class BlockSource(Protocol):
    """What the chain reads remote blocks from: :class:`HcpSource`, or what a remote spec's opener makes."""

    url: str

    def read_blocks(self, layer_id: str, indices: list[int]) -> ReadResult:
        """The 4 KiB blocks ``indices`` (strictly ascending, at most ``MAX_BATCH``) of layer ``layer_id``;
        SourceUnavailable once the source stayed out of reach for the retry window, SourceError on a
        refusal or a malformed answer."""
        ...

    def close(self) -> None: ...


def open_source(remote: RemoteSpec, retry: RetrySpec, *, compress: bool = True, level: int = 1) -> BlockSource:
    """The source of a remote spec: an agent over HCP, or what its ``opener`` makes (SourceError if the opener
    cannot be imported or refuses the spec)."""
    if remote.opener is None:
        return HcpSource(remote.url, remote.token_file, retry_seconds=retry.seconds,
                         initial_delay=retry.initial_delay, max_delay=retry.max_delay,
                         request_timeout=retry.request_timeout, compress=compress, level=level,
                         fingerprint=remote.fingerprint)
    module, _, function = remote.opener.partition(":")
    try:
        opener = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise SourceError(f"source {remote.url}: its opener {remote.opener} cannot be loaded: {exc}") from exc
    source: BlockSource = opener(remote.url, remote.token_file, retry)
    return source


def read_token(token_file: str | Path) -> str:
    try:
        return TokenSource.from_file(token_file).value
    except AuthFailed as exc:
        raise SourceError(f"source: {exc}") from exc


class HcpSource:
    """One source host (agent URL + token file). Thread-safe: many threads may read at once.
    ``transport`` replaces the stream-then-HTTP transport over TCP (e.g. an in-process one)."""

    def __init__(
        self,
        url: str,
        token_file: str | Path,
        *,
        retry_seconds: float = 10.0,
        initial_delay: float = 0.05,
        max_delay: float = 1.0,
        request_timeout: float = 30.0,
        compress: bool = True,
        level: int = 1,
        stream: bool = True,
        transport: Transport | None = None,
        fingerprint: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise SourceError(f"source URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.token_file = Path(token_file)
        self.retry_seconds = retry_seconds
        self.request_timeout = request_timeout
        self.compress = compress
        self.level = level
        try:
            self.token = TokenSource.from_file(self.token_file)
        except AuthFailed as exc:
            raise SourceError(f"source {self.url}: {exc}") from exc
        if transport is None:
            transport = HttpTransport(self.url, self.token, timeout=request_timeout,
                                      connect_timeout=min(5.0, request_timeout), max_connections=16,
                                      user_agent=protocol.user_agent(part="capsule-diskserver"),
                                      fingerprint=fingerprint)
            if stream:
                transport = StreamTransport(transport, self.token, timeout=request_timeout)
        self.base = transport
        policy = RetryPolicy(deadline=retry_seconds, initial_delay=initial_delay, max_delay=max_delay,
                             retry_refused=True, retry_status=_TRANSIENT_STATUS)
        self._transport = Retrying(Reauthenticating(transport, self.token), policy)

    @property
    def stream_active(self) -> bool:
        """True while READs go over the agent's block stream."""
        return isinstance(self.base, StreamTransport) and self.base.active

    def close(self) -> None:
        self._transport.close()

    def __repr__(self) -> str:
        return f"HcpSource({self.url!r})"

    def read_blocks(self, layer_id: str, indices: list[int]) -> ReadResult:
        """The 4 KiB blocks ``indices`` (strictly ascending, at most 1024) of layer ``layer_id``."""
        if not indices:
            return ReadResult([], 0, 0)
        if len(indices) > MAX_BATCH:
            raise SourceError(f"at most {MAX_BATCH} blocks per READ, not {len(indices)}")
        what = f"layer {layer_id[:12]}: source {self.url}"
        some = f"{len(indices)} block(s) from block {indices[0]}"
        call = read_call("layer", layer_id, indices, level=self.level, compress=self.compress)
        try:
            reply = self._transport.call(call.with_timeout(self.request_timeout))
        except HostKeyError as exc:
            raise SourceError(f"{what}: {exc}") from exc
        except Unreachable as exc:
            raise SourceUnavailable(f"{what} is unreachable or failing: {some} could not be fetched within "
                                    f"{self.retry_seconds:g} s (last error: {exc})") from exc
        except HashcacheError as exc:  # a malformed stream reply
            raise SourceError(f"{what} sent a malformed answer for {some}: {exc}") from exc
        if reply.status != 200:
            err = error_of(reply, "the agent")
            raise SourceError(f"{what} refused to send {some}: HTTP {reply.status}: {err}") from err
        try:
            blocks = unpack_blocks(reply.content, len(indices), compressed=self.compress)
        except HashcacheError as exc:
            raise SourceError(f"{what} sent a malformed answer for {some}: {exc}") from exc
        return ReadResult(blocks, reply.wire_bytes, reply.attempts)
