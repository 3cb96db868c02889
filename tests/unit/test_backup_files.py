"""Reading a backup's files without booting, in-process: paths checked before debugfs sees them, and a host
without the sandbox user told to run setup (the reader on a real qcow2 chain and the sandboxed tools:
tests/tools/test_backup_files.py)."""

from __future__ import annotations

import pytest

from capsule import sandbox
from capsule.backup.files import check_path
from capsule.errors import EnvironmentProblem, InvalidInput


@pytest.mark.unit
@pytest.mark.parametrize("path,normal", [("/", "/"), ("/etc/hostname", "/etc/hostname"), ("/a/./b", "/a/b"),
                                         ("//etc//x/", "/etc/x"), ("/sp ace/x", "/sp ace/x")])
def test_paths_are_normalised(path, normal):
    assert check_path(path) == normal


@pytest.mark.unit
@pytest.mark.parametrize("path", ["etc/hostname", "", "~/x", '/a"b', "/a\nb", "/a\x00b", "/a\x7fb", "/a/../b",
                                  "/.."])
def test_paths_debugfs_could_misread_are_refused(path):
    with pytest.raises(InvalidInput):
        check_path(path)


@pytest.mark.unit
def test_a_host_without_the_sandbox_user_is_told_to_run_setup(monkeypatch):
    monkeypatch.setattr(sandbox, "USER", "capsule-no-such-user")
    with pytest.raises(EnvironmentProblem, match="make setup"):
        sandbox.command(["debugfs", "-V"])


@pytest.mark.unit
def test_doctor_says_whether_the_sandbox_user_exists(monkeypatch):
    from capsule import doctor

    assert doctor._sandbox_check().ok
    monkeypatch.setattr(sandbox, "USER", "capsule-no-such-user")
    check = doctor._sandbox_check()
    assert not check.ok and "make setup" in check.detail
