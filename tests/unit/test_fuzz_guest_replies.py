"""Fuzzing what a guest answers once its JSON line has parsed (capsule/runtime/guestagent.py ``Reply`` and
``exec_result``, capsule/pod/replies.py): whatever shape the result has — fields missing, strings for numbers,
numbers out of range, nested junk — the reader returns checked values or raises AgentReplyInvalid, never
another exception; and what it returns keeps to the bounds (a checkpoint's size under the cap, its path
where the pod layer writes that pod's images)."""

from __future__ import annotations

import ipaddress
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from capsule.pod import replies
from capsule.runtime.guestagent import AgentReplyInvalid, exec_result
from tests.helpers.fuzzing import EDGE_INTS, MARKS, fuzz, json_values

pytestmark = MARKS

CAP = replies.image_cap(256)
GOOD = {"path": "/var/lib/pods/out/web-20250101T120000-42.pod", "size": 4096, "ip": "10.77.0.5/24",
        "dump_seconds": 0.5, "seconds": 0.7, "name": "web", "state": "running", "exit_code": 0, "signal": None,
        "timed_out": False, "stdout": "", "stderr": ""}
hostile_values = st.one_of(json_values, st.sampled_from(EDGE_INTS + [-1, CAP, CAP + 1, 1e300, -0.0, 2.5]),
                           st.sampled_from(list(GOOD.values())),
                           st.text(max_size=80).map(lambda t: "/var/lib/pods/out/web-" + t))


def results(keys: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """Mostly objects with the reader's keys (each its good value, dropped, or hostile), else any JSON."""
    field = {k: st.one_of(st.just(GOOD[k]), hostile_values) for k in keys}
    objects = st.fixed_dictionaries({}, optional=field).flatmap(
        lambda d: st.dictionaries(st.text(max_size=8), json_values, max_size=3).map(lambda extra: extra | d))
    return st.one_of(objects, objects, objects, json_values)


def typed_or_valid(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except AgentReplyInvalid as exc:
        assert str(exc)
        return None


@fuzz
@given(results(("exit_code", "signal", "timed_out", "stdout", "stderr")))
@example({"exit_code": True})
@example({"stdout": 5})
def test_exec_results(value):
    out = typed_or_valid(exec_result, value)
    if out is not None:
        assert isinstance(out["stdout"], str) and isinstance(out["stderr"], str)
        assert out["exit_code"] is None or type(out["exit_code"]) is int
        assert isinstance(out["timed_out"], bool)


@fuzz
@given(results(("path", "size", "ip", "dump_seconds", "seconds")))
@example({**GOOD, "size": CAP + 1})
@example({**GOOD, "size": "4096"})
@example({**GOOD, "path": "/var/lib/pods/out/web-20250101T120000-42.pod/../../x"})
def test_checkpoint_results(value):
    out = typed_or_valid(replies.dumped, value, "deb", "web", CAP)
    if out is not None:
        assert type(out.size) is int and 0 <= out.size <= CAP
        assert out.path.startswith("/var/lib/pods/out/web-") and ".." not in out.path and " " not in out.path
        ipaddress.IPv4Interface(out.ip)


@fuzz
@given(st.one_of(st.lists(results(("name", "ip", "state")), max_size=4), json_values))
@example([{"name": "web", "ip": {"a": 1}, "state": "running"}])
def test_pod_lists(value):
    out = typed_or_valid(replies.listed, value, "deb")
    if out is not None:
        for p in out:
            ipaddress.IPv4Interface(p["ip"])
            assert isinstance(p["name"], str) and isinstance(p["state"], str)
            assert replies.tagged("deb", p, "ls")["capsule"] == "deb"


@fuzz
@given(results(("name", "ip", "state", "seconds")))
def test_restore_results(value):
    out = typed_or_valid(replies.restored, value, "deb")
    if out is not None:
        assert isinstance(out["seconds"], int | float) and not isinstance(out["seconds"], bool)
