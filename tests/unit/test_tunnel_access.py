"""Who may open and use a tunnel session (capsule/exchange/tunnel.py), through the agent app over HTTP: staff
host calls only, no grant, a session only with the token that opened it, never after it expired or was
deleted, never a path the caller names — each refusal before a byte reaches the target. And a peer without the
tunnel is refused with both releases named."""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import uvicorn
from starlette.responses import JSONResponse
from starlette.testclient import WebSocketDenialResponse

from capsule import __version__
from capsule.accounts import tokens
from capsule.exchange import tunnel
from capsule.migrate.tunnelset import open_tunnels
from hashcache.errors import ProtocolMismatch
from hashcache.transport import protocol
from tests.helpers.grantworld import TOKEN, A, World, bearer, make_world
from tests.helpers.inprocess_agent import free_port
from tests.helpers.unixecho import Echo

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    w = make_world(tmp_path_factory.mktemp("tunnel"))
    yield w
    w.store.close()


@pytest.fixture
def target(world, tmp_path_factory) -> Iterator[Echo]:
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="tun-", dir="/tmp"))
    t = Echo(d / "libvirt.sock")
    registry: tunnel.Registry = world.app.state.tunnels
    registry.libvirt_socket, registry.tunnel_dir = t.path, d / "run"
    yield t
    registry.close_all()
    t.sock.close()
    shutil.rmtree(d, ignore_errors=True)


def _open(w: World, who: str = "operator", **body) -> dict:
    r = w.client.post("/v1/tunnel", json={"kinds": ["libvirt"]} | body, headers=bearer(w.t[who]))
    assert r.status_code == 200, r.text
    return r.json()


def _ws_status(w: World, path: str, token: str | None) -> int:
    try:
        with w.client.websocket_connect(path, headers=bearer(token) if token else {}):
            return 101
    except WebSocketDenialResponse as exc:
        return exc.status_code


def test_only_the_token_that_opened_a_session_uses_it(world, target):
    sid = _open(world)["session"]
    path = f"/v1/tunnel/{sid}/libvirt"
    refused = {
        "anonymous": (None, 401),
        "another user (an owner)": (world.t["alice"], 403),
        "another staff user": (world.t["admin"], 403),
        "the same user's other token": (world.t["host"], 403),
        "a read grant": (world.grant(allow="read", capsule=A), 403),
        "a push grant": (world.grant(allow="push", record=world.record(A, 9)), 403),
    }
    for who, (token, status) in refused.items():
        assert _ws_status(world, path, token) == status, who
    assert _ws_status(world, f"/v1/tunnel/{'0' * 32}/libvirt", world.t["operator"]) == 404
    assert _ws_status(world, f"/v1/tunnel/{sid}/qemu-disks", world.t["operator"]) == 404   # not opened
    assert target.accepted == 0                      # nothing reached the target
    with world.client.websocket_connect(path, headers=bearer(world.t["operator"])) as ws:
        ws.send_bytes(b"ping")
        assert ws.receive_bytes() == b"ping"
    assert target.accepted == 1


def test_an_expired_or_deleted_session_is_gone(world, target):
    registry: tunnel.Registry = world.app.state.tunnels
    sid = _open(world, ttl=10)["session"]
    registry._sessions[sid].expires = time.monotonic() - 1   # noqa: SLF001 - as if 10 s had passed
    assert _ws_status(world, f"/v1/tunnel/{sid}/libvirt", world.t["operator"]) == 404
    sid = _open(world)["session"]
    assert world.client.delete(f"/v1/tunnel/{sid}", headers=bearer(world.t["admin"])).status_code == 403
    assert world.client.delete(f"/v1/tunnel/{sid}", headers=bearer(world.t["operator"])).status_code == 200
    assert _ws_status(world, f"/v1/tunnel/{sid}/libvirt", world.t["operator"]) == 404
    assert world.client.delete(f"/v1/tunnel/{sid}", headers=bearer(world.t["operator"])).status_code == 404
    assert target.accepted == 0


@pytest.mark.parametrize("body", [
    {"kinds": ["/etc/shadow"]},
    {"kinds": ["libvirt"], "path": "/tmp/anywhere.sock"},
    {"channels": {"libvirt": "/tmp/anywhere.sock"}},
    {"kinds": [{"libvirt": "/tmp/anywhere.sock"}]},
    {"kinds": ["libvirt", "libvirt"]},
    {"kinds": []},
    {"kinds": ["libvirt"], "ttl": 0},
    {"kinds": ["libvirt"], "ttl": 10**9},
    [],
])
def test_a_caller_names_kinds_never_paths(world, target, body):
    registry: tunnel.Registry = world.app.state.tunnels
    r = world.client.post("/v1/tunnel", json=body, headers=bearer(world.t["operator"]))
    assert r.status_code == 400, r.text
    assert "kinds" in r.json()["detail"] or "ttl" in r.json()["detail"]
    assert not registry._sessions and not registry.tunnel_dir.exists()   # noqa: SLF001 - nothing made


def test_owners_and_grants_cannot_open_one(world, target):
    for token in (world.t["alice"], world.grant(allow="read", capsule=A),
                  world.grant(allow="push", record=world.record(A, 9)), None):
        r = world.client.post("/v1/tunnel", json={"kinds": ["libvirt"]}, headers=bearer(token) if token else {})
        assert r.status_code in (401, 403), r.text
    assert not world.app.state.tunnels._sessions   # noqa: SLF001


def test_qemu_kinds_get_a_path_of_this_hosts_choosing(world, target):
    got = _open(world, kinds=["libvirt", "qemu-migration", "qemu-disks"])
    paths = {k: c["path"] for k, c in got["channels"].items()}
    assert paths["libvirt"] is None                    # this host's libvirtd: not named to the caller
    mig, disks = Path(paths["qemu-migration"]), Path(paths["qemu-disks"])
    assert mig.parent == disks.parent and mig.parent.parent == target.path.parent / "run"
    assert mig.parent.stat().st_mode & 0o7777 == tunnel.SESSION_DIR_MODE
    assert got["session"] not in str(mig)              # the session id is not shown in a path
    world.client.delete(f"/v1/tunnel/{got['session']}", headers=bearer(world.t["operator"]))
    assert not mig.parent.exists()


def test_sessions_and_connections_are_bounded(world, target):
    sids = [_open(world)["session"] for _ in range(tunnel.SESSIONS_PER_CALLER)]
    r = world.client.post("/v1/tunnel", json={"kinds": ["libvirt"]}, headers=bearer(world.t["operator"]))
    assert r.status_code == 429 and "at most" in r.json()["detail"]
    _open(world, who="admin")                          # another caller still may
    s = world.app.state.tunnels.get(sids[0], tokens.resolve(world.store, world.t["operator"], TOKEN).who)
    held = [world.app.state.tunnels.connection(s, "libvirt") for _ in range(tunnel.CONNECTIONS_PER_CHANNEL)]
    for h in held:
        h.__enter__()
    assert _ws_status(world, f"/v1/tunnel/{sids[0]}/libvirt", world.t["operator"]) == 429
    for h in held:
        h.__exit__(None, None, None)
    assert target.accepted == 0


def test_every_answer_names_the_tunnel_feature(world):
    r = world.client.get("/v1/info", headers=bearer(world.t["operator"]))
    assert "tunnel" in protocol.features_of(r.headers.get(protocol.FEATURES))


def test_a_peer_without_the_tunnel_is_refused_naming_both_releases():
    async def older(scope, receive, send):    # an agent of the release before: no /v1/tunnel, no features
        assert scope["type"] == "http"
        await JSONResponse({"error": "not_found", "detail": "Not Found"}, status_code=404,
                           headers={protocol.HEADER: "2 capsule/0.1.9"})(scope, receive, send)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(older, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        with pytest.raises(ProtocolMismatch) as exc:
            open_tunnels(SimpleNamespace(url=f"http://127.0.0.1:{port}", token="t" * 20, fingerprint=None))
        assert "capsule 0.1.9 (protocol 2)" in str(exc.value) and f"capsule {__version__}" in str(exc.value)
        assert "tunnel" in str(exc.value)
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_memory_codec_is_negotiated_for_qemu_migration_only(world, target):
    oid = "ab" * 32
    got = _open(world, kinds=["libvirt", "qemu-migration"], dedup={"objects": [["layer", oid]]})
    assert got["dedup"] is True
    s = world.app.state.tunnels.get(got["session"], tokens.resolve(world.store, world.t["operator"], TOKEN).who)
    assert s.dedup == [("layer", oid)]
    assert world.app.state.tunnels.decoder(s, "qemu-migration") is not None
    assert world.app.state.tunnels.decoder(s, "libvirt") is None
    assert _open(world, kinds=["libvirt"], dedup=True)["dedup"] is False      # no channel to apply it to
    assert _open(world, kinds=["qemu-migration"])["dedup"] is False


def test_packing_is_negotiated_for_the_disks_channel_only(world, target):
    from capsule.migrate.streampack import Unpacker

    got = _open(world, kinds=["libvirt", "qemu-disks"], pack=["qemu-disks"])
    assert got["pack"] == ["qemu-disks"]
    s = world.app.state.tunnels.get(got["session"], tokens.resolve(world.store, world.t["operator"], TOKEN).who)
    assert isinstance(world.app.state.tunnels.decoder(s, "qemu-disks"), Unpacker)
    assert world.app.state.tunnels.decoder(s, "libvirt") is None
    assert _open(world, kinds=["libvirt"], pack=["qemu-disks"])["pack"] == []     # no such channel to unpack
    assert _open(world, kinds=["qemu-disks"])["pack"] == []


@pytest.mark.parametrize("pack", [["libvirt"], ["qemu-migration"], "qemu-disks", [["qemu-disks"]], {"x": 1}])
def test_a_malformed_pack_is_refused_and_makes_nothing(world, target, pack):
    r = world.client.post("/v1/tunnel", json={"kinds": ["qemu-disks"], "pack": pack},
                          headers=bearer(world.t["operator"]))
    assert r.status_code == 400, r.text
    assert "pack" in r.json()["detail"]
    assert not world.app.state.tunnels._sessions   # noqa: SLF001


@pytest.mark.parametrize("dedup", [{"objects": [["layer", "../x"]]}, {"objects": [["disk", "ab" * 32]]},
                                   {"objects": "all"}, {"paths": []}, 3])
def test_a_malformed_dedup_is_refused_and_makes_nothing(world, target, dedup):
    r = world.client.post("/v1/tunnel", json={"kinds": ["qemu-migration"], "dedup": dedup},
                          headers=bearer(world.t["operator"]))
    assert r.status_code == 400, r.text
    assert "dedup" in r.json()["detail"] or "object" in r.json()["detail"]
    assert not world.app.state.tunnels._sessions   # noqa: SLF001


@contextlib.contextmanager
def _peer(features: str, bodies: list[dict]) -> Iterator[SimpleNamespace]:
    """A peer's tunnel naming ``features``: a body with "dedup" is malformed there unless it names
    memory-dedup, one with "pack" unless it names tunnel-pack; each request's body is kept in ``bodies``."""
    async def app(scope, receive, send):
        import json

        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {protocol.HEADER: protocol.answer(__version__), protocol.FEATURES: features}
        req = json.loads(body or b"{}")
        bodies.append(req)
        if scope["method"] == "POST" and ("dedup" in req and "memory-dedup" not in features
                                          or "pack" in req and "tunnel-pack" not in features):
            reply = JSONResponse({"error": "invalid_name", "detail": "malformed tunnel request"}, 400, headers)
        else:
            reply = JSONResponse({"session": "s" * 32, "expires_in": 60, "dedup": "dedup" in req,
                                  "pack": req.get("pack", []),
                                  "channels": {"libvirt": {"path": None}, "qemu-migration": {"path": "/x/q.sock"},
                                               "qemu-disks": {"path": "/x/d.sock"}}},
                                 200, headers)
        await reply(scope, receive, send)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", token="t" * 20, fingerprint=None)
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_peer_without_the_codec_gets_the_bytes_as_they_came():
    from capsule.migrate.ramdedup import Known
    from capsule.migrate.tunnelset import Dedup

    bodies: list[dict] = []
    with _peer("tunnel,live-move", bodies) as peer, \
            open_tunnels(peer, ("libvirt", "qemu-migration"), local_dir=Path(tempfile.mkdtemp(dir="/tmp")),
                         dedup=Dedup([], Known([1]))) as t:
        assert not t.dedup and t.tunnels["qemu-migration"].known is None
    assert "dedup" in bodies[0] and "dedup" not in bodies[1]


@pytest.mark.parametrize("features, runs", [("tunnel,live-move,memory-dedup", False),
                                            ("tunnel,live-move,memory-dedup,memory-runs", True)])
def test_held_pages_go_as_runs_only_to_a_peer_that_names_them(features, runs):
    from capsule.migrate.ramdedup import Known
    from capsule.migrate.tunnelset import Dedup

    with _peer(features, []) as peer, \
            open_tunnels(peer, ("qemu-migration",), local_dir=Path(tempfile.mkdtemp(dir="/tmp")),
                         dedup=Dedup([], Known([1]))) as t:
        assert t.dedup and t.tunnels["qemu-migration"].known is not None
        assert t.tunnels["qemu-migration"].runs is runs


def test_a_tunnel_connection_holds_little_unsent_so_qemu_sees_the_link_rate():
    from capsule.migrate.sendqueue import MAX_NOT_SENT, MIN_NOT_SENT, set_bound

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp, socket.socket(socket.AF_UNIX) as unix:
        set_bound(tcp)
        set_bound(unix)             # not TCP: left alone, no error
        set_bound(None)
        assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == MAX_NOT_SENT
        set_bound(tcp, MIN_NOT_SENT)
        assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == MIN_NOT_SENT


def test_the_unsent_bound_is_a_quarter_second_of_the_links_rate_within_its_limits():
    from capsule.migrate.sendqueue import MAX_NOT_SENT, MIN_NOT_SENT, SendQueue

    now = [0.0]
    q = SendQueue(clock=lambda: now[0])
    assert q.current == MAX_NOT_SENT and q.bound(0) is None
    sent = 0
    answers = []
    for _ in range(20):                     # 384 kbit/s: 48,000 bytes a second leave
        now[0] += 0.5
        sent += 24_000
        answers.append(q.bound(sent))
    assert [a for a in answers if a is not None] == [MIN_NOT_SENT]   # 12,000 bytes a quarter second: the floor
    assert q.current == MIN_NOT_SENT
    for _ in range(20):                     # the link speeds up: 300 kB/s, a bound of 75 kB
        now[0] += 0.5
        sent += 150_000
        q.bound(sent)
    assert 0.75 * 75_000 <= q.current <= 75_000    # (moved again only when off by a quarter)
    for _ in range(20):                     # a LAN: the ceiling
        now[0] += 0.5
        sent += 50_000_000
        q.bound(sent)
    assert q.current == MAX_NOT_SENT


@pytest.mark.parametrize("features, packed", [("tunnel,live-move,memory-dedup", False),
                                              ("tunnel,live-move,memory-dedup,tunnel-pack", True)])
def test_the_disks_go_packed_only_to_a_peer_that_names_it(features, packed):
    from capsule.migrate.ramdedup import Known
    from capsule.migrate.tunnelset import Dedup

    bodies: list[dict] = []
    with _peer(features, bodies) as peer, \
            open_tunnels(peer, ("qemu-migration", "qemu-disks"), local_dir=Path(tempfile.mkdtemp(dir="/tmp")),
                         dedup=Dedup([], Known([1]))) as t:
        assert t.tunnels["qemu-disks"].pack is packed
        assert not t.tunnels["qemu-migration"].pack and t.dedup          # the memory keeps its own codec
    posts = [b for b in bodies if "kinds" in b]        # (the last request is the session's DELETE)
    assert posts[0]["pack"] == ["qemu-disks"] and ("pack" in posts[-1]) is packed
