"""A tiny HCP client for the disk server: READ blocks of one layer from its source host's agent.

Only the one call demand paging needs (§4.3, §4.4.3), READ, over the agent's block stream (a WebSocket
per thread, diskserver/stream.py) or, from an agent without one, over HTTP::

    POST {url}/v1/objects/layer/{id}/read?level=L&compress=true|false
         Authorization: Bearer TOKEN
         body = encode_indices(ascending block indices)   → the blocks, concatenated (zstd unless compress=false)

Transient failures (connection refused or reset, timeouts, HTTP 5xx/429) are retried with exponential
back-off until ``retry_seconds`` have passed since the first attempt; then :class:`SourceUnavailable`
is raised. A refusal (HTTP 4xx) or a malformed answer raises :class:`SourceError` at once. The
client does not check block content: the caller verifies every block against its manifest hash.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from websockets.exceptions import WebSocketException

from diskserver.errors import SourceError, SourceUnavailable
from diskserver.stream import BlockStream, StreamRefused, StreamUnsupported
from hashcache.errors import HashcacheError
from hashcache.hcp import MAX_BATCH, encode_indices, unpack_blocks

log = logging.getLogger("diskserver")

_TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504, 507})


@dataclass(frozen=True)
class ReadResult:
    blocks: list[bytes]
    wire_bytes: int  # request + response bytes, headers included (approximately)
    attempts: int


def read_token(token_file: str | Path) -> str:
    try:
        token = Path(token_file).read_text().strip()
    except OSError as exc:
        raise SourceError(f"cannot read the source token file {token_file}: {exc.strerror or exc}") from exc
    if not token:
        raise SourceError(f"the source token file {token_file} is empty")
    return token


class HcpSource:
    """One source host (agent URL + token). Thread-safe: many threads may read at once."""

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
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise SourceError(f"source URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.token_file = Path(token_file)
        self.retry_seconds = retry_seconds
        self.initial_delay = initial_delay
        self.max_delay = max_delay
        self.request_timeout = request_timeout
        self.compress = compress
        self.level = level
        self._token = read_token(self.token_file)
        # Minimal headers: on a 384 kbit/s link every byte of every request counts.
        self._client = httpx.Client(
            base_url=self.url,
            headers={"User-Agent": "capsule-diskserver", "Accept": "*/*", "Accept-Encoding": "identity"},
            timeout=httpx.Timeout(request_timeout, connect=min(5.0, request_timeout)),
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=16),
        )
        self._stream: BlockStream | None = BlockStream(self.url) if stream else None

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._client.close()

    def __repr__(self) -> str:
        return f"HcpSource({self.url!r})"

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"}

    def read_blocks(self, layer_id: str, indices: list[int]) -> ReadResult:
        """The 4 KiB blocks ``indices`` (strictly ascending, at most 1024) of layer ``layer_id``."""
        if not indices:
            return ReadResult([], 0, 0)
        if len(indices) > MAX_BATCH:
            raise ValueError(f"at most {MAX_BATCH} blocks per READ, not {len(indices)}")
        what = f"layer {layer_id[:12]}: source {self.url}"
        start = time.monotonic()
        deadline = start + self.retry_seconds
        delay = self.initial_delay
        attempts = 0
        reauthed = False
        while True:
            attempts += 1
            timeout = max(0.5, min(self.request_timeout, deadline - time.monotonic()))
            try:
                payload, wire = self._read_once(layer_id, indices, timeout)
            except _Refused as exc:
                if exc.status == 401 and not reauthed:
                    reauthed = True  # the token may have been rotated: read the file again, once
                    with contextlib.suppress(SourceError):
                        self._token = read_token(self.token_file)
                    continue
                if exc.status not in _TRANSIENT_STATUS:
                    raise SourceError(f"{what} refused to send {len(indices)} block(s) from block {indices[0]}: "
                                      f"HTTP {exc.status}: {exc.detail}") from None
                last_error = f"HTTP {exc.status}: {exc.detail}"
            except _Transient as exc:
                last_error = str(exc)
            else:
                try:
                    blocks = unpack_blocks(payload, len(indices), compressed=self.compress)
                except HashcacheError as exc:
                    raise SourceError(f"{what} sent a malformed answer for {len(indices)} block(s) from "
                                      f"block {indices[0]}: {exc}") from exc
                if attempts > 1:
                    log.warning("%s is answering again (after %d attempts, %.1f s)", what, attempts,
                                time.monotonic() - start)
                return ReadResult(blocks, wire, attempts)
            now = time.monotonic()
            if attempts == 1:
                log.warning("%s: %s; retrying for up to %.1f s", what, last_error, self.retry_seconds)
            if now >= deadline:
                raise SourceUnavailable(
                    f"{what} is unreachable or failing: {len(indices)} block(s) from block {indices[0]} could not "
                    f"be fetched within {self.retry_seconds:g} s ({attempts} attempts; last error: {last_error})")
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, self.max_delay)

    def _read_once(self, layer_id: str, indices: list[int], timeout: float) -> tuple[bytes, int]:
        """One READ: over the block stream while the agent has one, else over HTTP. (payload, wire bytes)."""
        if self._stream is not None:
            try:
                return self._stream.read(self._token, "layer", layer_id, indices,
                                         self.level if self.compress else 0, timeout)
            except StreamUnsupported:
                log.info("source %s has no block stream: READs go over HTTP", self.url)
                self._stream = None
            except StreamRefused as exc:
                raise _Refused(exc.status, exc.detail) from None
            except HashcacheError as exc:
                raise SourceError(f"layer {layer_id[:12]}: source {self.url} sent a malformed stream reply: "
                                  f"{exc}") from exc
            except (OSError, TimeoutError, WebSocketException) as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
        body = encode_indices(indices)
        params = {"level": str(self.level), "compress": "true" if self.compress else "false"}
        try:
            resp = self._client.post(f"/v1/objects/layer/{layer_id}/read", params=params, content=body,
                                     headers=self._auth(), timeout=httpx.Timeout(timeout, connect=min(5.0, timeout)))
        except httpx.TransportError as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
        if resp.status_code != 200:
            raise _Refused(resp.status_code, _detail(resp))
        return resp.content, _wire_bytes(resp, len(body))


class _Transient(Exception):
    """Connection refused or reset, a timeout: worth another try."""


class _Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


def _detail(resp: httpx.Response) -> str:
    try:
        data = resp.json()
        if isinstance(data, dict) and "detail" in data:
            return str(data["detail"])[:300]
    except ValueError:
        pass
    return resp.text[:300] or resp.reason_phrase


def _wire_bytes(resp: httpx.Response, body_len: int) -> int:
    req = resp.request
    head = sum(len(k) + len(v) + 4 for k, v in req.headers.raw) + len(req.url.raw_path) + 16
    head += sum(len(k) + len(v) + 4 for k, v in resp.headers.raw) + 17
    return head + body_len + resp.num_bytes_downloaded
