"""An HTTP client for another host's agent, counting the bytes it moves."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from capsule.errors import (
    AuthFailed,
    CapsuleError,
    Conflict,
    IntegrityError,
    InvalidName,
    NotFound,
    RuntimeFailure,
    StorageFull,
    TransferFailed,
    Unreachable,
)

_BY_STATUS: dict[int, type[CapsuleError]] = {400: InvalidName, 401: AuthFailed, 404: NotFound, 409: Conflict,
                                              413: TransferFailed, 422: IntegrityError, 507: StorageFull}


def read_token(token_file: Path | None) -> str:
    """The client's token: ``--token-file`` or ``CAPSULE_TOKEN``."""
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise AuthFailed(f"cannot read the token file {token_file}: {exc.strerror}") from exc
    else:
        token = os.environ.get("CAPSULE_TOKEN", "").strip()
    if not token:
        raise AuthFailed("no token: pass --token-file FILE or set CAPSULE_TOKEN")
    return token


_RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0)
# a connection that stalled or broke (a refused connection or an unknown host fails at once)
_STALLED = (httpx.TimeoutException, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class AgentClient:
    def __init__(self, url: str, token: str, timeout: float = 120.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidName(f"agent URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        # minimal headers: on a 384 kbit/s link every byte of every request counts
        self._client = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}",
                                                                "User-Agent": "capsule", "Accept": "*/*",
                                                                "Accept-Encoding": "identity"},
                                    timeout=httpx.Timeout(timeout, connect=30.0),
                                    limits=httpx.Limits(max_connections=32, max_keepalive_connections=32))
        self._lock = threading.Lock()
        self.wire_bytes = 0

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, request: httpx.Request, response: httpx.Response) -> int:
        head = sum(len(k) + len(v) + 4 for k, v in request.headers.raw) + len(request.url.raw_path) + 16
        head += sum(len(k) + len(v) + 4 for k, v in response.headers.raw) + 17
        n = head + len(request.content) + response.num_bytes_downloaded
        with self._lock:
            self.wire_bytes += n
        return n

    def request(self, method: str, path: str, *, content: bytes | None = None, json_body: Any = None,
                params: dict[str, Any] | None = None, idempotent: bool | None = None) -> httpx.Response:
        """One call. An idempotent one (GETs, unless told otherwise) whose connection stalls or breaks — a
        timeout or a reset: on a congested slow link TCP can stall a connection for minutes — is tried
        again with back-off (1, 2, 4, 8, 16 s) before :class:`Unreachable`."""
        if json_body is not None:
            content = json.dumps(json_body).encode()
        retries = len(_RETRY_DELAYS) if (method == "GET" if idempotent is None else idempotent) else 0
        for attempt in range(retries + 1):
            try:
                resp = self._client.request(method, path, content=content, params=params,
                                            headers={"Content-Type": "application/json"} if json_body is not None
                                            else None)
                break
            except httpx.TransportError as exc:
                if attempt == retries or not isinstance(exc, _STALLED):
                    tries = f" ({attempt + 1} attempts)" if attempt else ""
                    raise Unreachable(f"cannot reach the agent at {self.url}{tries}: {str(exc) or type(exc).__name__}"
                                      ) from exc
                time.sleep(_RETRY_DELAYS[attempt])
        self._count(resp.request, resp)
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text[:200]
            cls = _BY_STATUS.get(resp.status_code, RuntimeFailure)
            raise cls(f"agent {self.url}: {detail}")
        return resp

    def get_json(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params or None).json()

    def post_json(self, path: str, body: Any) -> Any:
        return self.request("POST", path, json_body=body).json()
