"""One conformance suite for every transport to an agent: HTTP and the block stream over loopback TCP
(uvicorn in a thread), plain and with TLS (the certificate pinned by its fingerprint), and the same two
driven in-process (the unit tier's transport). Each runs against the real agent app on a fresh store."""

from __future__ import annotations

import contextlib
import time

import pytest

from capsule.agentclient import AgentClient
from capsule.errors import AuthFailed, InvalidName, NotFound, Unreachable
from hashcache.errors import HostKeyError
from hashcache.hcp import unpack_blocks
from hashcache.transport import (
    Call,
    Counting,
    HttpTransport,
    RateLimited,
    Retrying,
    RetryPolicy,
    StreamTransport,
    check,
    read_call,
    tls,
)
from hashcache.transport.base import TokenSource
from hashcache.transport.memory import in_process
from tests.helpers.transport_fixtures import NBLOCKS, TOKEN, DroppingTransport, agent_app, serve

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

KINDS = ["http", "stream", "https", "stream-tls", "memory-http", "memory-stream"]
FAST = RetryPolicy(delays=(0.05, 0.05, 0.05))


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    cert = tls.ensure_host_cert(tmp_path_factory.mktemp("tls"))
    with agent_app(tmp_path_factory.mktemp("agent")) as a, serve(a) as url, serve(a, cert) as tls_url:
        a.url, a.tls_url, a.fingerprint = url, tls_url, cert.fingerprint
        yield a


@pytest.fixture(params=KINDS)
def make(request, agent):
    """make(token=TOKEN) → a fresh transport of this kind to the agent."""
    opened = []

    def factory(token: str = TOKEN):
        tok = TokenSource(token)
        kind = request.param
        if kind == "http":
            t = HttpTransport(agent.url, tok, timeout=10)
        elif kind == "stream":
            t = StreamTransport(HttpTransport(agent.url, tok, timeout=10), tok, timeout=10)
        elif kind == "https":
            t = HttpTransport(agent.tls_url, tok, timeout=10, fingerprint=agent.fingerprint)
        elif kind == "stream-tls":
            t = StreamTransport(HttpTransport(agent.tls_url, tok, timeout=10, fingerprint=agent.fingerprint), tok,
                                timeout=10)
        else:
            t = in_process(agent.dropper, tok, stream=kind == "memory-stream",
                           wrap=lambda inner: DroppingTransport(inner, agent.dropper))
        opened.append(t)
        return t

    agent.dropper.drops = 0
    yield factory
    agent.dropper.drops = 0
    for t in opened:
        t.close()


def test_get_json(make, agent):
    reply = check(make().call(Call.get("/v1/info")), "agent")
    assert reply.status == 200 and "store_id" in reply.json()


def test_post_json(make, agent):
    missing = "ab" * 32
    body = {"layers": [missing], "files": [agent.file_id]}
    reply = check(make().call(Call.post_json("/v1/objects/missing", body)), "agent")
    assert reply.json() == {"layers": [missing], "files": []}


@pytest.mark.parametrize("compress", [True, False])
def test_read_blocks(make, agent, compress):
    t = make()
    want = [0, 5, 17, NBLOCKS - 1]
    reply = check(t.call(read_call("file", agent.file_id, want, level=1, compress=compress)), "agent")
    assert unpack_blocks(reply.content, len(want), compressed=compress) == [agent.data[i] for i in want]
    if isinstance(t, StreamTransport):
        assert t.active  # it went over the stream, not the HTTP fallback


def test_a_wrong_token_is_auth_failed_and_never_retried(make, agent):
    inner = Counting(make(token="wrong-token-0123456789"))
    t = Retrying(inner, RetryPolicy(delays=(0.01,) * 5, retry_refused=True, retry_status=frozenset({401, 503})))
    for call in (Call.get("/v1/info"), read_call("file", agent.file_id, [1], level=1)):
        reply = t.call(call)
        assert reply.status == 401 and reply.attempts == 1
        with pytest.raises(AuthFailed, match="agent: "):
            check(reply, "agent")
    assert inner.calls == 2


def test_an_unknown_object_is_not_found(make, agent):
    t = make()
    for call in (Call.get(f"/v1/objects/layer/{'cd' * 32}"), read_call("layer", "cd" * 32, [0], level=1)):
        with pytest.raises(NotFound, match=r"agent: no layer cdcdcdcdcdcd"):
            check(t.call(call), "agent")
    with pytest.raises(InvalidName, match="malformed object id"):
        check(t.call(Call.get("/v1/objects/layer/XYZ")), "agent")


def test_a_dropped_connection_is_retried_for_idempotent_calls_only(make, agent):
    t = Retrying(make(), FAST)
    agent.dropper.drops = 2
    reply = t.call(Call.get("/v1/info"))
    assert reply.status == 200 and reply.attempts == 3
    agent.dropper.drops = 2
    reply = t.call(read_call("file", agent.file_id, [3], level=1))
    assert reply.status == 200 and reply.attempts == 3
    assert unpack_blocks(reply.content, 1) == [agent.data[3]]
    agent.dropper.drops = 1
    with pytest.raises(Unreachable):
        t.call(Call.post_json("/v1/objects/missing", {"layers": [], "files": []}))  # not idempotent
    assert agent.dropper.drops == 0
    agent.dropper.drops = 10
    with pytest.raises(Unreachable, match=r"\(4 attempts"):
        t.call(Call.get("/v1/info"))


def test_byte_counts(make, agent):
    t = Counting(make())
    replies = [t.call(Call.get("/v1/info")),
               t.call(read_call("file", agent.file_id, list(range(NBLOCKS)), level=1, compress=False))]
    assert t.wire_bytes == sum(r.wire_bytes for r in replies)
    assert t.calls == 2
    for r in replies:
        assert r.wire_bytes >= len(r.content) + 1
    assert replies[1].wire_bytes >= NBLOCKS * 4096


def test_the_agent_client_raises_the_agents_classes(make, agent):
    with AgentClient("http://x.invalid", TOKEN, transport=make(), retry=FAST) as client:
        assert "store_id" in client.get_json("/v1/info")
        with pytest.raises(NotFound, match=r"^agent http://x.invalid: no layer"):
            client.get_json(f"/v1/objects/layer/{'ef' * 32}")
        assert client.wire_bytes > 0


def test_a_refused_connection_fails_at_once():
    from tests.conftest import free_port

    t = Retrying(HttpTransport(f"http://127.0.0.1:{free_port()}", "x" * 20), RetryPolicy(delays=(5.0,)))
    start = time.monotonic()
    with pytest.raises(Unreachable) as exc:
        t.call(Call.get("/v1/info"))
    assert exc.value.refused and time.monotonic() - start < 2.0
    t.close()


def test_rate_limiting_holds_calls_back(agent):
    slept: list[float] = []
    t = RateLimited(in_process(agent.app, TOKEN, stream=False), bytes_per_second=10_000, burst=10_000,
                    sleep=slept.append)
    with contextlib.closing(t):
        for _ in range(3):  # 3 × 40 blocks uncompressed = 480 KiB of answers at 10 kB/s
            check(t.call(read_call("file", agent.file_id, list(range(NBLOCKS)), level=1, compress=False)), "a")
    assert sum(slept) >= (3 * NBLOCKS * 4096 - 10_000) / 10_000 * 0.99


@pytest.mark.parametrize("stream", [False, True])
def test_over_tls_another_certificate_is_refused_before_the_token_is_sent(agent, stream):
    """A pin that is not the server's certificate: ssh's warning naming both fingerprints, for HTTP and for
    the block stream, never retried (a retry cannot make it right)."""
    wrong = "SHA256:" + "A" * 43
    tok = TokenSource(TOKEN)
    inner = HttpTransport(agent.tls_url, tok, timeout=10, fingerprint=wrong)
    t = Retrying(StreamTransport(inner, tok, timeout=10) if stream else inner,
                 RetryPolicy(delays=(0.01,) * 3, retry_refused=True))
    seen = agent.dropper.seen
    for call in (Call.get("/v1/info"), read_call("file", agent.file_id, [1], level=1)):
        with pytest.raises(HostKeyError, match="REMOTE HOST IDENTIFICATION HAS CHANGED") as exc:
            t.call(call)
        assert wrong in str(exc.value) and agent.fingerprint in str(exc.value)
        assert "capsule host rm" in str(exc.value) and "--fingerprint" in str(exc.value)
    assert agent.dropper.seen == seen  # no request reached the app
    t.close()


def test_over_tls_without_a_pin_a_self_signed_certificate_is_not_trusted(agent):
    t = HttpTransport(agent.tls_url, TOKEN, timeout=10)
    with pytest.raises(HostKeyError, match=r"cannot trust the agent at https://127\.0\.0\.1:\d+.*capsule host add"):
        t.call(Call.get("/v1/info"))
    t.close()
