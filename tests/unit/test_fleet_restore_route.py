"""``POST /v1/fleet/restore`` (a rollout --via: the host restores a version from a repository), through the
agent's real HTTP app: only a host call may make it, every field is checked before the repository is contacted
(every connection attempt is recorded and refused here), an error never echoes the key or the credentials, and
nothing of them is written to the store."""

from __future__ import annotations

import base64
import json
import socket

import pytest
from fastapi.testclient import TestClient
from hypothesis import example, given
from hypothesis import strategies as st

from capsule.agent.app import create_app
from capsule.store import Store
from tests.helpers.fuzzing import fuzz, json_values
from tests.unit.test_accounts_agent import SECRET, TOKEN, accounts, bearer, make_home

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROUTE = "/v1/fleet/restore"
MASTER = bytes(range(64))
MASTER_B64 = base64.b64encode(MASTER).decode()
SECRET_KEY = "the-s3-secret-key-0123456789"
KEY_ID = "0123456789abcdef0123456789abcdef"
GOOD = {"repository": "s3+http://127.0.0.1:9/fleet/web", "ref": "web@2",
        "key": {"id": KEY_ID, "master": MASTER_B64},
        "credentials": {"access_key": "capsule", "secret_key": SECRET_KEY}, "region": "us-east-1"}


def _with(**changes):
    body = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GOOD.items()}
    for path, value in changes.items():
        *outer, last = path.split("__")
        target = body
        for p in outer:
            target = target[p]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    return body


BAD = {
    "not an object": [],
    "unknown field": _with(extra=1),
    "no credentials": _with(credentials=...),
    "ftp scheme": _with(repository="ftp://127.0.0.1:9/fleet"),
    "https scheme": _with(repository="https://127.0.0.1:9/fleet"),
    "no bucket": _with(repository="s3+http://127.0.0.1:9/"),
    "port out of range": _with(repository="s3+http://127.0.0.1:70000/fleet"),
    "port zero": _with(repository="s3+http://127.0.0.1:0/fleet"),
    "user in url": _with(repository="s3+http://me:pw@127.0.0.1:9/fleet"),
    "bad host": _with(repository="s3+http://bad_host!:9/fleet"),
    "dot-dot prefix": _with(repository="s3+http://127.0.0.1:9/fleet/../x"),
    "url too long": _with(repository="s3+http://127.0.0.1:9/fleet/" + "a" * 2000),
    "ref without version": _with(ref="web"),
    "bad ref name": _with(ref="../x@1"),
    "ref not a string": _with(ref=2),
    "short master key": _with(key__master=base64.b64encode(MASTER[:32]).decode()),
    "master not base64": _with(key__master="!" * 88),
    "bad key id": _with(key__id="KEY"),
    "key id with newline": _with(key__id=KEY_ID + "\n"),
    "extra key field": _with(key__passphrase="x"),
    "empty access key": _with(credentials__access_key=""),
    "secret key with space": _with(credentials__secret_key="has space " + SECRET_KEY),
    "secret key too long": _with(credentials__secret_key="s" * 300),
    "secret key not a string": _with(credentials__secret_key=7),
    "unknown credential": _with(credentials__region="x"),
    "bad region": _with(region="EU West\n"),
    "region not a string": _with(region=1),
}


@pytest.fixture
def connects(monkeypatch):
    """Every TCP connection this process tries to open (by address), each refused at once."""
    tried: list[tuple] = []

    def refuse(address, *args, **kw):  # noqa: ANN001, ANN002, ANN003
        tried.append(address)
        raise ConnectionRefusedError(111, "refused by the test")

    monkeypatch.setattr(socket, "create_connection", refuse)
    return tried


@pytest.fixture
def agent(tmp_path):
    home = make_home(tmp_path)
    app = create_app(home, TOKEN)
    store = Store.open(home)
    yield TestClient(app), store, home
    store.close()


def _nothing_kept(store: Store, home) -> None:
    assert store.catalogue.version("web", 2) is None
    for p in home.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            assert MASTER not in data and MASTER_B64.encode() not in data and SECRET_KEY.encode() not in data, p


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_fields_are_refused_before_any_contact_and_never_echo_the_secrets(agent, connects, name):
    client, store, home = agent
    r = client.post(ROUTE, json=BAD[name], headers=bearer(TOKEN))
    assert r.status_code == 400 and r.json()["error"] == "invalid_name", r.text
    assert SECRET_KEY not in r.text and MASTER_B64 not in r.text and "me:pw" not in r.text
    assert connects == []
    assert client.get("/v1/fleet/activity", headers=bearer(TOKEN)).json()["pulls"] == []
    _nothing_kept(store, home)


def test_a_good_request_reaches_only_the_named_store_and_an_unreachable_one_is_a_clear_error(agent, connects):
    client, store, home = agent
    r = client.post(ROUTE, json=GOOD, headers=bearer(TOKEN))
    assert r.status_code == 503 and r.json()["error"] == "unreachable", r.text
    assert "127.0.0.1:9" in r.json()["detail"]
    assert connects and all(a[:2] == ("127.0.0.1", 9) for a in connects)
    assert SECRET_KEY not in r.text and MASTER_B64 not in r.text
    _nothing_kept(store, home)


def test_only_a_host_call_may_restore(agent, connects):
    client, store, home = agent
    assert client.post(ROUTE, json=GOOD).status_code == 401
    tokens = accounts(store)
    assert store.catalogue.capsule(SECRET) is not None
    for who in ("alice", "bob", "operator"):         # a user's read/capsules token: no host scope
        r = client.post(ROUTE, json=GOOD, headers=bearer(tokens[who]))
        assert r.status_code == 403 and r.json()["error"] == "forbidden", (who, r.text)
    assert connects == []
    for who in ("host", "admin"):                   # the host scope: checked, then the store is tried
        r = client.post(ROUTE, json=GOOD, headers=bearer(tokens[who]))
        assert r.status_code == 503 and r.json()["error"] == "unreachable", (who, r.text)
    _nothing_kept(store, home)


PATHS = ["repository", "ref", "key", "key__id", "key__master", "credentials", "credentials__access_key",
         "credentials__secret_key", "credentials__session_token", "region", "extra"]


@pytest.fixture(scope="module")
def fuzzed_agent(tmp_path_factory):
    home = make_home(tmp_path_factory.mktemp("fuzz"))
    with TestClient(create_app(home, TOKEN)) as client:
        yield client


@fuzz
@given(st.sampled_from(PATHS), json_values)
@example("repository", float("inf"))           # was: the test client could not even send it
@example("region", None)                       # a valid request: only the named endpoint is tried
def test_any_value_in_any_field_is_a_typed_answer_and_contacts_no_other_store(fuzzed_agent, path, value):
    tried: list = []

    def refuse(address, *args, **kw):  # noqa: ANN001, ANN002, ANN003
        tried.append(address)
        raise ConnectionRefusedError(111, "refused by the test")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket, "create_connection", refuse)
        body = json.dumps(_with(**{path: value})).encode()      # NaN and Infinity as Python writes them
        r = fuzzed_agent.post(ROUTE, content=body, headers=bearer(TOKEN) | {"Content-Type": "application/json"})
    assert (r.status_code, r.json()["error"]) in ((400, "invalid_name"), (503, "unreachable")), r.text[:300]
    assert all(a[:2] == ("127.0.0.1", 9) for a in tried)
    assert SECRET_KEY not in r.text and MASTER_B64 not in r.text
