"""The tier checks themselves: a test without exactly one tier, a test outside its tier's folder, or a
unit test that needs images, stops collection; a unit test cannot start a process; unit tests get the
short timeout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.tiers import TESTS, TIERS, UNIT_TIMEOUT, ProcessStarted, check_tiers, no_processes

pytestmark = pytest.mark.unit


class FakeItem:
    def __init__(self, *marks: str, fixtures: tuple[str, ...] = (), folder: str | None = None) -> None:
        """A test marked ``marks`` in a file of tests/``folder``/ (by default its tier's folder)."""
        folder = next((m for m in marks if m in TIERS), "unit") if folder is None else folder
        self.path = TESTS / folder / "test_x.py"
        self.nodeid = f"{self.path.relative_to(TESTS.parent)}::test_{'_'.join(marks) or 'none'}"
        self.marks = {m: getattr(pytest.mark, m) for m in marks}
        self.fixturenames = fixtures

    def get_closest_marker(self, name):
        mark = self.marks.get(name)
        return None if mark is None else mark.mark

    def add_marker(self, mark):
        self.marks[mark.name] = mark


@pytest.mark.parametrize(("marks", "fixtures", "needle"), [
    ((), (), "has none"),
    (("unit", "vm"), (), "has unit, vm"),
    (("slow",), (), "has none"),
    (("unit",), ("tmp_path", "tiny_images"), "uses the image fixture(s) tiny_images"),
    (("unit",), ("two_hosts",), "mark it tools or vm"),
])
def test_wrong_tiers_stop_collection(marks, fixtures, needle):
    with pytest.raises(pytest.UsageError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_tiers([FakeItem(*marks, fixtures=fixtures)])


@pytest.mark.parametrize(("marks", "folder", "needle"), [
    (("tools",), "unit", "tests/unit/test_x.py::test_tools: marked tools but lives in tests/unit/: move its file "
                         "to tests/tools/"),
    (("unit",), "tools", "marked unit but lives in tests/tools/: move its file to tests/unit/"),
    (("vm", "slow"), "unit", "marked vm but lives in tests/unit/"),
    (("browser",), "", "marked browser but lives in tests/: move its file to tests/browser/"),
])
def test_a_test_outside_its_tiers_folder_stops_collection(marks, folder, needle):
    with pytest.raises(pytest.UsageError, match=needle.replace(".", r"\.")):
        check_tiers([FakeItem(*marks, folder=folder)])


def test_every_collected_test_of_the_suite_lives_in_its_tiers_folder(request):
    """The real suite as this run collected it (whatever -m selected): each item's file is in its tier's
    folder (else collection would have stopped before this test ran)."""
    for item in request.session.items:
        tier = next(t for t in TIERS if item.get_closest_marker(t) is not None)
        assert item.path.resolve().relative_to(TESTS).parts[0] == tier, item.nodeid


def test_good_tiers_pass_and_unit_tests_get_the_short_timeout():
    unit, vm, slow_vm = FakeItem("unit"), FakeItem("vm", fixtures=("store",)), FakeItem("vm", "slow")
    check_tiers([unit, vm, slow_vm, FakeItem("tools", fixtures=("tiny_images",)), FakeItem("hosts")])
    assert unit.get_closest_marker("timeout").args == (UNIT_TIMEOUT,)
    assert vm.get_closest_marker("timeout") is None


def test_a_unit_test_cannot_start_a_process():
    # this test is itself a unit test, so the guard is already on: a process cannot start here
    with pytest.raises(ProcessStarted, match="mark the test `tools`"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(ProcessStarted):
        os.fork()
    with pytest.raises(ProcessStarted):
        os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], os.environ)


def test_the_guard_puts_everything_back():
    before = (os.fork, os.posix_spawn, subprocess._fork_exec)
    for tier in ("unit", "tools"):
        guard = no_processes(FakeItem(tier))
        next(guard)
        with pytest.raises(StopIteration):
            next(guard)
        assert (os.fork, os.posix_spawn, subprocess._fork_exec) == before


def test_wait_until_returns_the_value_or_fails_with_what_it_waited_for():
    from tests.wait import wait_until

    calls = []
    assert wait_until(lambda: calls.append(1) or (len(calls) >= 3 and "ready"), 5, "three calls", interval=0) == "ready"
    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting for the moon \(seen 0\)"):
        wait_until(lambda: False, 0.05, lambda: "the moon (seen 0)", interval=0.01)


def test_the_suites_guest_processes_share_out_every_guest_file_once_and_keep_shared_guests_together():
    """scripts/suite.py runs the guest tiers as two processes: each guest-tier file is in exactly one, and
    every file that asks for the compose hosts or the pod pairs (one session fixture each: two processes
    would start them twice) is in the one that runs them."""
    from scripts import suite

    processes = {name: [a for a in args if not a.startswith("-")] for name, args in suite.guest_processes().items()}
    every = {str(p.relative_to(TESTS.parent)) for tier in ("vm", "hosts", "browser")
             for p in (TESTS / tier).glob("test_*.py")}
    assert sorted(f for files in processes.values() for f in files) == sorted(every)
    users = {f for f in every if suite.fixtures_asked(TESTS.parent / f) & {"hosts", "seeded", "pod_pair"}}
    assert {"tests/hosts/test_demo.py", "tests/vm/test_pods.py"} <= users <= set(processes["hosts"])
    assert all(f.startswith(("tests/vm/", "tests/browser/")) for f in processes["vm"])


def test_the_suite_names_each_failed_test_in_one_line_at_its_end():
    """On CI pytest prints a failure's whole message in its short summary; the suite's own last lines must
    still name each failed test, whatever its message's length."""
    from scripts import suite

    log = ["tests/tools/test_x.py::test_a PASSED\n", "FAILED tests/tools/test_x.py::test_b - assert b'" +
           "\\x00" * 500 + "'\n", "     b'\\x00\\x00'\n", "ERROR tests/unit/test_y.py::test_c - OSError\n"]
    got = suite._failures("light", log)
    assert got[0].startswith("light | FAILED tests/tools/test_x.py::test_b - assert") and len(got[0]) <= 208
    assert got[1:] == ["light | ERROR tests/unit/test_y.py::test_c - OSError"]
