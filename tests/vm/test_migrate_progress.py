"""A migration's phases and its cancel on a real tiny guest between two stores and two agents: the events the
CLI and the dashboard draw, in order and only forward, and a cancel that leaves the guest running at the
source with its counter going on."""

from __future__ import annotations

import pytest

from capsule import capsules, lifecycle
from capsule.migrate import MigrationCancelled, migrate
from capsule.migrate.progress import CancelToken, Snapshot
from capsule.runtime.connection import lookup_domain
from tests.helpers.guest import COUNTER, count, run, wait_count_above, write_blocks

pytestmark = [pytest.mark.vm, pytest.mark.timeout(400)]


def _forward(events: list[Snapshot]) -> None:
    for before, after in zip(events, events[1:], strict=False):
        assert after.seq > before.seq and after.index >= before.index
        assert after.wire_bytes >= before.wire_bytes and after.local_bytes >= before.local_bytes
        assert after.done_bytes >= before.done_bytes


def _running_counter(store, name: str) -> int:
    capsules.create(store, name, "tiny", memory="256M")
    lifecycle.start(store, name)
    run(store, name, COUNTER)
    write_blocks(store, name, 700, 64)  # a disk layer of its own to move
    return wait_count_above(store, name, 5)


@pytest.mark.parametrize("mode", ["full", "demand"])
def test_the_phases_come_in_order_and_the_guest_goes_on_at_the_destination(two_hosts, mode):
    a, b, agent_a, agent_b = two_hosts
    before = _running_counter(a, "p")
    events: list[Snapshot] = []
    r = migrate(a, "p", agent_b.url, agent_b.token, mode=mode, balloon="cache", source_url=agent_a.url,
                source_token=agent_a.token, on_event=events.append, to_name="b")
    want = ["balloon", "save", "memory", "disk", "resume"] if mode == "full" else ["balloon", "save", "memory",
                                                                                    "resume"]
    assert list(dict.fromkeys(e.phase for e in events if e.phase)) == want
    _forward(events)
    last = events[-1]
    assert last is r.last and last.outcome == "done" and last.where == "destination" and last.version == "p@2"
    assert last.done_bytes == last.total_bytes > 0 and last.wire_bytes > 0
    # the destination held the tiny image already: its kernel and initrd (and in full mode the root layer)
    # were found there, not sent
    assert last.local_bytes > 0
    assert lookup_domain(a.domain_name("p")) is None and lookup_domain(b.domain_name("p")) is not None
    after = count(b, "p")
    assert before <= after < before + 40
    assert wait_count_above(b, "p", after) > after


def test_cancel_mid_transfer_leaves_the_guest_running_at_the_source(two_hosts):
    a, b, _agent_a, agent_b = two_hosts
    before = _running_counter(a, "c")
    token = CancelToken()
    events: list[Snapshot] = []

    def listener(s: Snapshot) -> None:
        events.append(s)
        if s.phase == "disk":  # the memory image went over; stop in the middle of the disks
            token.cancel()

    with pytest.raises(MigrationCancelled) as info:
        migrate(a, "c", agent_b.url, agent_b.token, on_event=listener, cancel=token, to_name="b")
    err = info.value
    assert err.restored and err.version == "c@2" and err.step == "push"
    _forward(events)
    assert events[-1].outcome == "cancelled" and events[-1].where == "source" and events[-1].phase == "disk"
    assert b.catalogue.version("c", 2) is None            # never recorded there, never started there
    assert lookup_domain(b.domain_name("c")) is None
    assert lookup_domain(a.domain_name("c")) is not None
    assert a.catalogue.instance("c").version == 2
    after = count(a, "c")
    assert before <= after < before + 40
    assert wait_count_above(a, "c", after) > after


class _SlowDestination:
    """A destination agent that takes its time to say which objects it lacks (all of them), and fails
    anything after that: a migration is in its memory phase for a few seconds."""

    def __init__(self, delay: float) -> None:
        import json
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.calls: list[str] = []
        calls = self.calls

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:
                pass

            def do_GET(self) -> None:
                calls.append(f"GET {self.path}")
                self.send_error(404)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                calls.append(f"POST {self.path.split('?')[0]}")
                if not self.path.startswith("/v1/objects/missing"):
                    self.send_error(500)
                    return
                time.sleep(delay)
                data = json.dumps(json.loads(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_ctrl_c_cancels_capsule_migrate_and_the_guest_runs_here_again(store, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from capsule.errors import Cancelled
    from tests.wait import wait_until

    before = _running_counter(store, "k")
    slow = _SlowDestination(delay=4.0)
    token_file = tmp_path / "dest.token"
    token_file.write_text("t" * 32)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "capsule.cli.main", "--home", str(store.home), "migrate", "k",
                             "--to", slow.url, "--token-file", str(token_file), "--offline"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: "POST /v1/objects/missing" in slow.calls or proc.poll() is not None, 120,
                   "the migration never reached the push")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        slow.close()
    assert proc.returncode == Cancelled.exit_code, (out, err)
    assert "cancelled" in err and "runs here again" in err
    assert not any(c.startswith("POST /v1/recv") for c in slow.calls)   # no object went out
    assert lookup_domain(store.domain_name("k")) is not None
    assert store.catalogue.instance("k").version == 2
    after = count(store, "k")
    assert before <= after and wait_count_above(store, "k", after) > after
