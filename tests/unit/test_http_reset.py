"""A connection reset, or a TLS handshake cut short, while it opens is a stalled link (tried again), not a
refused one."""

from __future__ import annotations

import httpx
import pytest

from hashcache.transport import Call, HttpTransport

pytestmark = [pytest.mark.unit]


def _transport(exc: Exception) -> HttpTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    client = httpx.Client(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(handler))
    return HttpTransport("http://127.0.0.1:9", "t", client=client)


@pytest.mark.parametrize(("exc", "refused"), [
    (httpx.ConnectError("[Errno 104] Connection reset by peer"), False),
    (httpx.ConnectError("[Errno 111] Connection refused"), True),
    (httpx.ReadError("[Errno 104] Connection reset by peer"), False),
    # a TLS handshake the agent closed (busy, restarting): someone listens, so it is tried again
    (httpx.ConnectError("[SSL: UNEXPECTED_EOF_WHILE_READING] EOF occurred in violation of protocol (_ssl.c:992)"),
     False),
])
def test_a_reset_while_connecting_is_retried_and_a_refused_connection_is_not(exc, refused):
    from hashcache.errors import Unreachable

    with pytest.raises(Unreachable) as info:
        _transport(exc).call(Call("GET", "/v1/info"))
    assert info.value.refused is refused
