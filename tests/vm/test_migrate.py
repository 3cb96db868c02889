"""capsule migrate between two local hosts: full copy and demand paging."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from capsule.lifecycle import demand
from capsule.migrate import MigrationFailed, migrate
from capsule.runtime.connection import lookup_domain
from tests.helpers.guest import COUNTER, count, run, wait_count_above

pytestmark = pytest.mark.vm


@pytest.mark.parametrize("mode", ["full", "demand"])
def test_migrate_keeps_the_guest_running(two_hosts, mode):
    a, b, agent_a, agent_b = two_hosts
    capsules.create(a, "m", "tiny", memory="256M")
    lifecycle.start(a, "m")
    run(a, "m", COUNTER)
    run(a, "m", "dd if=/dev/urandom of=/dev/vda bs=4096 seek=700 count=16 conv=notrunc 2>/dev/null; sync")
    before = wait_count_above(a, "m", 5)
    r = migrate(a, "m", agent_b.url, agent_b.token, mode=mode, balloon="cache",
                source_url=agent_a.url, source_token=agent_a.token)
    assert r.remote["mode"] == "restore"
    assert lookup_domain(a.domain_name("m")) is None
    assert lookup_domain(b.domain_name("m")) is not None
    after = count(b, "m")
    assert before <= after < before + 30
    assert wait_count_above(b, "m", after) > after
    if mode == "demand":
        assert r.push is None and r.remote["remote_layers"]  # the written layer stayed at A
    else:
        assert r.push is not None and any(o.kind == "layer" for o in r.push.objects)


@pytest.mark.parametrize("two_hosts", [True], ids=["tls"], indirect=True)
def test_a_demand_migration_over_tls_pins_both_hosts(two_hosts):
    """A pins B by the fingerprint given; B pages A's disk in pinned to A's own host key, which migrate
    sends with the run request (A's store's certificate, the one its agent serves)."""
    a, b, agent_a, agent_b = two_hosts
    capsules.create(a, "m", "tiny", memory="256M")
    lifecycle.start(a, "m")
    run(a, "m", COUNTER)
    run(a, "m", "dd if=/dev/urandom of=/dev/vda bs=4096 seek=700 count=16 conv=notrunc 2>/dev/null; sync")
    before = wait_count_above(a, "m", 5)
    r = migrate(a, "m", agent_b.url, agent_b.token, mode="demand", fingerprint=agent_b.fingerprint,
                source_url=agent_a.url, source_token=agent_a.token)
    assert r.remote["mode"] == "restore" and r.remote["remote_layers"]
    assert {demand.remote_info(b, lid)["fingerprint"] for lid in r.remote["remote_layers"]} == {agent_a.fingerprint}
    after = count(b, "m")
    assert before <= after < before + 30
    assert wait_count_above(b, "m", after) > after


class _FailingAgent:
    """A destination agent that fails deterministically: at the push (``push``: it lacks every object, then
    refuses the first upload) or at the start (``start``: it has every object, records the version, then
    cannot start it)."""

    def __init__(self, fail_at: str) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        calls: list[str] = []
        self.calls = calls

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                calls.append(f"GET {self.path}")
                if "/versions/" in self.path and fail_at == "start":
                    self._reply(200, {})
                else:
                    self._reply(404, {"detail": "no such version"})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                calls.append(f"POST {self.path.split('?')[0]}")
                if self.path.startswith("/v1/objects/missing"):
                    req = json.loads(body)
                    self._reply(200, req if fail_at == "push" else {"layers": [], "files": []})
                elif self.path.startswith("/v1/versions"):
                    self._reply(200, {"version": "x", "created": True})
                else:
                    self._reply(500, {"detail": "the destination broke down"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fail_at", ["push", "start"])
def test_failed_migration_restores_the_guest_at_the_source(store, fail_at):
    fake = _FailingAgent(fail_at)
    try:
        capsules.create(store, "f", "tiny", memory="256M")
        lifecycle.start(store, "f")
        run(store, "f", COUNTER)
        before = wait_count_above(store, "f", 5)
        with pytest.raises(MigrationFailed) as info:
            migrate(store, "f", fake.url, "token")
    finally:
        fake.close()
    err = info.value
    assert err.version == "f@2" and err.step == fail_at and err.restored
    assert "f@2" in str(err) and "runs here again" in str(err)
    assert ("POST /v1/capsules/f/start" in fake.calls) == (fail_at == "start")
    if fail_at == "push":
        assert err.reached.present == [] and len(err.reached.missing) == 4  # layer, kernel, initrd, memory
    else:
        assert err.reached.missing == [] and err.reached.recorded
    # the guest runs here again from the version the suspend made, its counter going on
    assert lookup_domain(store.domain_name("f")) is not None
    assert store.catalogue.instance("f").version == 2
    after = count(store, "f")
    assert before <= after < before + 30
    assert wait_count_above(store, "f", after) > after
