"""Fuzzing the host side of the guest agent's JSON lines (capsule/runtime/guestagent.py): whatever a
guest writes on its channel — garbage, JSON of any shape, replies to other ids, endless lines, JSON
nested deeper than Python's recursion limit — a call returns the reply's result or raises
AgentUnavailable / AgentError, within its deadline."""

from __future__ import annotations

import itertools
import json
import socket
import threading

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from capsule.errors import CapsuleError
from capsule.runtime.guestagent import AgentError, AgentUnavailable, GuestAgent
from tests.helpers.fuzzing import MARKS, deep_json, fuzz, json_values

pytestmark = MARKS


def agent_fed(data: bytes, timeout: float = 5.0) -> tuple[GuestAgent, socket.socket]:
    """A GuestAgent whose channel (one end of a socket pair) has ``data`` waiting, then end of file."""
    host, guest = socket.socketpair()
    agent = GuestAgent.__new__(GuestAgent)
    agent.path, agent.timeout, agent._ids, agent._buf, agent._sock = "<fuzz>", timeout, itertools.count(1), b"", host
    agent._synced = False

    def feed() -> None:
        try:
            guest.sendall(data)
            guest.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=feed, daemon=True).start()
    return agent, guest


def reply_for_call(draw_result: object, ok: object) -> bytes:
    return json.dumps({"id": 1, "ok": ok, "result": draw_result}).encode()


lines = st.one_of(
    st.binary(max_size=80),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(reply_for_call, json_values, json_values),
    st.builds(lambda rid, v: json.dumps({"id": rid, "ok": True, "result": v}).encode(), json_values, json_values),
    st.builds(lambda r: json.dumps({"id": 1, "ok": True, "result": r}).encode(),
              st.dictionaries(st.text(max_size=8), json_values, max_size=3)),
    st.just(deep_json()),
)


@fuzz
@given(st.lists(lines, max_size=6), st.sampled_from([b"\n", b"\r\n", b""]))
@example([deep_json(), b'{"id": 1, "ok": true, "result": {"x": 1}}'], b"\n")  # was RecursionError
def test_any_reply_lines_give_a_result_or_a_typed_error(reply_lines, end):
    agent, guest = agent_fed(b"\n".join(reply_lines) + end)
    try:
        result = agent.call("ping", timeout=5.0)
    except (AgentUnavailable, AgentError) as exc:
        assert isinstance(exc, CapsuleError)
        return
    finally:
        agent.close()
        guest.close()
    assert isinstance(result, dict)


def test_a_deeply_nested_line_is_skipped_like_any_garbage():
    """Regression: a guest line of 5000 nested arrays raised RecursionError out of call()."""
    agent, guest = agent_fed(deep_json() + b'\n{"id": 1, "ok": true, "result": {"pong": 1}}\n')
    try:
        assert agent.call("ping") == {"pong": 1}
    finally:
        agent.close()
        guest.close()


def test_an_error_reply_of_any_shape_is_an_agent_error():
    agent, guest = agent_fed(b'{"id": 1, "ok": false, "error": [1, {"x": null}]}\n')
    try:
        with pytest.raises(AgentError, match="ping"):
            agent.call("ping")
    finally:
        agent.close()
        guest.close()
