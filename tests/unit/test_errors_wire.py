"""One error root, one mapping at each boundary: every registered error class goes across the wire
(the agent's HTTP answer and its block stream) and comes back at the client as the same class with
the same message and fields; the CLI exits with the class's code and prints one line, never a traceback
(also for a disk-server error and for an unexpected ValueError)."""

from __future__ import annotations

import importlib

import pytest
from fastapi import FastAPI, WebSocket

from capsule.agentclient import AgentClient
from capsule.cli import main as cli_main
from capsule.errors import InvalidName
from diskserver.errors import BlockMismatch, SourceUnavailable, SpecError
from hashcache.errors import Error, Internal, registered
from hashcache.hcp import decode_stream_read, encode_stream_error
from hashcache.transport import Call, check, read_call
from hashcache.transport.memory import in_process
from tests.helpers.transport_fixtures import TOKEN, agent_app

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

MODULES = ("hashcache.errors", "hashcache.hcp", "hashcache.shadow", "hashcache.cache", "diskserver.errors",
           "capsule.errors", "capsule.runtime.guestagent", "capsule.imagebuild.common", "capsule.imagebuild.qemuboot",
           "capsule.migrate.move", "capsule.migrate.live")
SAMPLE_FIELDS = {"object_name": "layer 0123456789ab", "block": 7, "layer_id": "cd" * 32, "version": "vm@4",
                 "step": "push", "restored": True, "retry_after": 30, "doing": "stopping", "limit": 2,
                 "refusals": [{"reason": "not_running", "detail": "start it"}]}


def _ours() -> list[type[Error]]:
    for m in MODULES:
        importlib.import_module(m)
    return sorted((c for c in registered().values() if c.__module__.split(".")[0] in ("hashcache", "diskserver",
                                                                                      "capsule")),
                  key=lambda c: c.code)


CLASSES = _ours()


def _sample(cls: type[Error]) -> Error:
    fields = {f: SAMPLE_FIELDS[f] for f in cls.fields}
    return cls(f"{cls.__name__} went wrong: see “here”", **fields)


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


def test_there_is_one_root_and_every_class_has_its_own_code():
    assert len(CLASSES) >= 30
    mine = {c for c in _all_subclasses(Error) if c.__module__.split(".")[0] in ("hashcache", "diskserver", "capsule")}
    assert mine == set(CLASSES) - {Error}
    codes = [c.code for c in CLASSES]
    assert len(set(codes)) == len(codes)
    for c in CLASSES:
        assert isinstance(c.exit_code, int) and 1 <= c.exit_code < 126, c
        assert 400 <= c.http_status <= 599, c
    from capsule.errors import CapsuleError
    from diskserver.errors import DiskServerError
    from hashcache.errors import HashcacheError

    for root in (CapsuleError, DiskServerError, HashcacheError):
        assert issubclass(root, Error)


def _stream_app() -> FastAPI:
    """A block stream whose READ of object id n fails with the n-th class, encoded as the agent does."""
    app = FastAPI()
    by_index = dict(enumerate(CLASSES))

    @app.websocket("/v1/objects/stream")
    async def stream(ws: WebSocket) -> None:
        await ws.accept()
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            _kind, oid, _level, _raw = decode_stream_read(msg["bytes"])
            exc = _sample(by_index[int(oid, 16)])
            await ws.send_bytes(encode_stream_error(str(exc), exc.code, exc.http_status))

    return app


@pytest.fixture(scope="module")
def raising(tmp_path_factory):
    """The real agent app (its own exception handlers) with one more route: GET /raise/{code}."""
    with agent_app(tmp_path_factory.mktemp("agent")) as agent:

        @agent.app.get("/raise/{code}")
        def raise_it(code: str) -> None:
            raise _sample(registered()[code])

        yield in_process(agent.app, TOKEN, stream=False)


@pytest.fixture(scope="module")
def stream():
    return in_process(_stream_app(), TOKEN)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.code)
def test_every_class_crosses_the_wire_and_back(raising, stream, cls, capsys, monkeypatch):
    sent = _sample(cls)
    client = AgentClient("http://peer.example", TOKEN, transport=raising)
    with pytest.raises(Error) as got:
        client.request("GET", f"/raise/{cls.code}")
    assert type(got.value) is cls
    assert str(got.value) == f"agent http://peer.example: {sent}"
    for f in cls.fields:
        assert getattr(got.value, f) == getattr(sent, f)

    # the block stream carries the same code
    reply = stream.call(read_call("layer", f"{CLASSES.index(cls):064x}", [0], level=1))
    with pytest.raises(Error) as over_stream:
        check(reply, "peer")
    assert type(over_stream.value) is cls and str(over_stream.value) == f"peer: {sent}"
    assert reply.status == cls.http_status

    # the command line: the class's exit code and one line
    def fail() -> None:
        raise got.value

    monkeypatch.setattr(cli_main, "app", fail)
    with pytest.raises(SystemExit) as exited:
        cli_main.main()
    assert exited.value.code == cls.exit_code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "went wrong" in err and len(err.strip().splitlines()) <= 2


def test_the_real_agent_answers_with_the_code_and_fields(tmp_path):
    """create_app's own handlers: a disk-server error and a ValueError are typed answers, not bare 500s."""
    with agent_app(tmp_path / "a") as agent:
        app = agent.app

        @app.get("/test/diskserver")
        def diskserver_error() -> None:
            raise BlockMismatch("layer cdcd: block 9 from there does not match", layer_id="cd" * 32, block=9)

        @app.get("/test/unavailable")
        def unavailable() -> None:
            raise SourceUnavailable("layer cdcd: source gone")

        @app.get("/test/value")
        def value_error() -> None:
            int("not a number")

        t = in_process(app, TOKEN, stream=False)
        client = AgentClient("http://a.example", TOKEN, transport=t)
        with pytest.raises(BlockMismatch) as exc:
            client.get_json("/test/diskserver")
        assert (exc.value.layer_id, exc.value.block) == ("cd" * 32, 9)
        reply = t.call(Call.get("/test/diskserver"))
        assert reply.status == 422 and reply.json() == {"error": "block_mismatch", "layer_id": "cd" * 32, "block": 9,
                                                        "detail": "layer cdcd: block 9 from there does not match"}
        with pytest.raises(SourceUnavailable, match="source gone"):
            client.get_json("/test/unavailable")
        with pytest.raises(Internal, match=r"ValueError: invalid literal for int\(\).*please report this"):
            client.get_json("/test/value")
        # a malformed query parameter is bad input (400), not an integrity error
        with pytest.raises(InvalidName, match="malformed request: query.start"):
            client.get_json(f"/v1/objects/file/{agent.file_id}/records", start="abc")


@pytest.mark.parametrize(("exc", "code", "needle"), [
    (SourceUnavailable("layer ab: the source stayed away"), 12, "the source stayed away"),
    (SpecError("chain.json: no layers"), 6, "no layers"),
    (ValueError("memory image has 2 disks, the version has 1"), Internal.exit_code, "report"),
])
def test_the_cli_never_shows_a_traceback(exc, code, needle, monkeypatch, capsys):
    def fail() -> None:
        raise exc

    monkeypatch.setattr(cli_main, "app", fail)
    monkeypatch.delenv("CAPSULE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exited:
        cli_main.main()
    err = capsys.readouterr().err
    assert exited.value.code == code
    assert needle in err and "Traceback" not in err


def test_an_error_from_an_older_peer_by_class_name_is_understood():
    from capsule.errors import NotFound
    from hashcache.errors import from_wire

    exc = from_wire({"detail": "no capsule named 'x'", "error": "NotFound"}, 404, "agent a: ")
    assert type(exc) is NotFound and str(exc) == "agent a: no capsule named 'x'"
    bare = from_wire({"detail": "request body over 1024 bytes"}, 413)
    assert bare.code == "too_large" and bare.exit_code == 13
    assert type(from_wire("Internal Server Error", 500)) is Internal


def test_errors_survive_pickling():
    import pickle

    for cls in CLASSES:
        exc = _sample(cls)
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is cls and str(back) == str(exc)
        assert all(getattr(back, f) == getattr(exc, f) for f in cls.fields)



def test_a_peer_answering_garbage_is_a_protocol_error_not_a_traceback():
    from fastapi.responses import Response

    from hashcache.hcp import ProtocolError

    app = FastAPI()

    @app.get("/v1/info")
    def info() -> Response:
        return Response(b"<html>not json</html>", media_type="text/html")

    @app.get("/v1/broken")
    def broken() -> Response:
        return Response(b"<html>proxy error</html>", status_code=502, media_type="text/html")

    with AgentClient("http://odd.example", TOKEN, transport=in_process(app, TOKEN, stream=False)) as client:
        with pytest.raises(ProtocolError, match="malformed JSON"):
            client.get_json("/v1/info")
        with pytest.raises(Error, match="agent http://odd.example: <html>proxy error") as exc:
            client.get_json("/v1/broken")
        assert exc.value.exit_code == 13  # a peer that sent something wrong
