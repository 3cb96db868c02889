"""When a failed migration may start the guest again at the source, and what its error says."""

from __future__ import annotations

import httpx
import pytest

from capsule.errors import NotFound, RuntimeFailure, TransferFailed, Unreachable
from capsule.migrate.move import MigrationFailed, Reached, _may_run_there

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _unreachable(cause: Exception) -> Unreachable:
    try:
        try:
            raise cause
        except httpx.HTTPError as exc:
            raise Unreachable("cannot reach the agent") from exc
    except Unreachable as exc:
        return exc


def test_a_failed_push_never_leaves_the_guest_running_there():
    for exc in (TransferFailed("bad block"), _unreachable(httpx.ReadTimeout("slow")), ValueError("bad reply")):
        assert not _may_run_there("push", exc)


@pytest.mark.parametrize("step", ["start", "run"])
def test_the_other_host_may_run_it_only_when_its_answer_was_lost(step):
    assert not _may_run_there(step, RuntimeFailure("agent: restoring failed"))          # it answered: no
    assert not _may_run_there(step, NotFound("agent: no such version"))
    assert not _may_run_there(step, _unreachable(httpx.ConnectError("refused")))       # never reached it
    assert _may_run_there(step, _unreachable(httpx.ReadTimeout("no answer")))          # sent, no answer
    assert _may_run_there(step, _unreachable(httpx.RemoteProtocolError("cut")))
    assert _may_run_there(step, ValueError("the reply was not JSON"))                  # it answered 200


def test_the_error_names_the_version_and_what_reached_the_other_host():
    reached = Reached(present=["k", "i"], missing=["m"], sent_bytes=3 * 1024 * 1024)
    assert reached.describe("vm@4") == ("2 of the 3 objects of vm@4 are at the other host (not recorded there); "
                                        "3.0 MiB sent")
    assert "unknown" in Reached(known=False).describe("vm@4")
    err = MigrationFailed("x", version="vm@4", step="push", restored=True, reached=reached,
                          cause=Unreachable("gone"))
    assert err.exit_code == Unreachable.exit_code and err.version == "vm@4" and err.restored
    assert MigrationFailed("x", version="vm@4", step="start", restored=True, reached=reached,
                           cause=OSError("?")).exit_code == RuntimeFailure.exit_code
