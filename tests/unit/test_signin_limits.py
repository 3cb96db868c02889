"""Sign-in under attack, on a real agent app: the limits are checked before any password is hashed (a burst at once
included), passwords are hashed a few at a time in their own pool (429 beyond its queue), the client address is
the connection's (X-Forwarded-For changes nothing), a flood of new addresses does not lift the limit of one over
it, a password change ends the user's sessions, and the cookie is named for its store."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from capsule.accounts import passwords, users
from capsule.agent.app import create_app
from capsule.agent.sessions import Attempts
from capsule.errors import TooManyAttempts
from capsule.store import Store
from tests.unit.test_accounts_agent import PASSWORD, SECRET, TOKEN, Clock, accounts, make_home

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def world(tmp_path):
    home = make_home(tmp_path)
    app = create_app(home, TOKEN)
    app.state.sign_in_attempts.clock = Clock()
    store = Store.open(home)
    accounts(store)
    yield app, store
    store.close()


class ScryptSpy:
    """Counts scrypt runs and the most at once; each takes ``delay`` seconds longer, and waits for ``gate`` (so
    calls overlap as long as the test wants)."""

    def __init__(self, monkeypatch, delay: float = 0.0) -> None:
        self.calls = self.inside = self.most = 0
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        real = passwords._scrypt

        def spy(*args):
            with self.lock:
                self.calls += 1
                self.inside += 1
                self.most = max(self.most, self.inside)
            try:
                self.gate.wait(30)
                time.sleep(delay)
                return real(*args)
            finally:
                with self.lock:
                    self.inside -= 1

        monkeypatch.setattr(passwords, "_scrypt", spy)


def burst(client: TestClient, bodies: list[dict]) -> list[int]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: client.post("/api/session", json=b).status_code, bodies))


def test_refused_sign_ins_cost_no_scrypt_even_in_a_burst(world, monkeypatch):
    app, _ = world
    spy = ScryptSpy(monkeypatch, delay=0.3)
    with TestClient(app) as client:
        codes = burst(client, [{"user": "alice", "password": f"wrong guess {i}"} for i in range(20)])
        assert sorted(set(codes)) == [401, 429] and codes.count(401) == 5   # the limit, not 20 guesses
        assert spy.calls == 5
        for _ in range(10):
            r = client.post("/api/session", json={"user": "alice", "password": PASSWORD})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert spy.calls == 5                                                 # refused: no scrypt spent


def test_passwords_are_hashed_a_few_at_a_time_and_a_full_queue_is_429(world, monkeypatch):
    app, _ = world
    app.state.sign_in_attempts.limit = 1000
    spy = ScryptSpy(monkeypatch)
    spy.gate.clear()                    # the first two hash until all the others have come
    with TestClient(app) as client, ThreadPoolExecutor(14) as threads:
        futures = [threads.submit(client.post, "/api/session", json={"user": f"guess{i}", "password": "wrong pw"})
                   for i in range(14)]
        deadline = time.monotonic() + 30
        while sum(f.done() for f in futures) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = [f.result() for f in futures if f.done()]   # 2 hashing, 8 waiting: the other 4, at once
        spy.gate.set()
        codes = [f.result().status_code for f in futures]
    assert [r.status_code for r in refused] == [429] * 4 and all(r.headers["retry-after"] == "1" for r in refused)
    assert "too many sign-ins at once" in refused[0].json()["detail"]
    assert spy.most == 2 and spy.calls == 10 and codes.count(401) == 10 and codes.count(429) == 4


def test_x_forwarded_for_does_not_change_the_address_limited(world):
    app, _ = world
    client = TestClient(app)
    for i in range(5):
        r = client.post("/api/session", json={"token": "wrong-token-0123456789"},
                        headers={"X-Forwarded-For": f"10.0.0.{i}"})
        assert r.status_code == 401
    r = client.post("/api/session", json={"token": "wrong-token-0123456789"}, headers={"X-Forwarded-For": "10.9.9.9"})
    assert r.status_code == 429


def test_a_flood_of_new_addresses_does_not_lift_a_limit(world):
    app, _ = world
    client = TestClient(app)
    for _ in range(5):
        assert client.post("/api/session", json={"token": "wrong-token-0123456789"}).status_code == 401
    assert client.post("/api/session", json={"token": TOKEN}).status_code == 429
    attempts: Attempts = app.state.sign_in_attempts
    for i in range(10_001):           # as many other addresses failing once each
        attempts.failed(f"address:10.{i >> 16}.{(i >> 8) & 255}.{i & 255}")
    assert client.post("/api/session", json={"token": TOKEN}).status_code == 429
    assert len(attempts._failures) <= 10_000


def test_eviction_keeps_keys_over_the_limit_and_drops_expired_ones_first():
    clock = Clock()
    a = Attempts(limit=2, window=60, clock=clock)
    a.max_keys = 10
    a.failed("address:old")
    clock.now += 61
    for _ in range(2):
        a.failed("address:over")
    for i in range(20):
        a.failed(f"address:{i}")
    with pytest.raises(TooManyAttempts):
        a.check("address:over")
    assert "address:old" not in a._failures and len(a._failures) <= 10


def test_a_password_change_ends_the_users_sessions(world):
    app, store = world
    browsers = [TestClient(app), TestClient(app)]
    for b in browsers:
        assert b.post("/api/session", json={"user": "alice", "password": PASSWORD}).status_code == 200
        assert b.get("/api/capsules").status_code == 200
    root = TestClient(app)
    assert root.post("/api/session", json={"user": "root", "password": PASSWORD}).status_code == 200
    users.set_password(store, "alice", "a new password")        # what `capsule user passwd` calls
    for b in browsers:
        assert b.get("/api/capsules").status_code == 401
    assert root.get("/api/capsules").status_code == 200          # another user's session stands
    r = browsers[0].post("/api/session", json={"user": "alice", "password": "a new password"})
    assert r.status_code == 200 and [c["name"] for c in browsers[0].get("/api/capsules").json()] == [SECRET]
    # removed and added again (same name, another password): the old sessions do not come back
    users.remove(store, "alice")
    users.add(store, "alice", "owner", PASSWORD)
    assert browsers[0].get("/api/capsules").status_code == 401


def test_the_session_cookie_is_named_for_the_store(world):
    app, store = world
    client = TestClient(app)
    r = client.post("/api/session", json={"user": "alice", "password": PASSWORD})
    name = app.state.sessions.cookie
    assert name == f"capsule_session_{store.id}" and r.headers["set-cookie"].startswith(f"{name}=")
    sid = client.cookies[name]
    plain = TestClient(app)
    plain.cookies.set("capsule_session", sid)
    assert plain.get("/api/capsules").status_code == 401
    plain.cookies.set(name, sid)
    assert plain.get("/api/capsules").status_code == 200
