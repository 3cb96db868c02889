"""The update verbs' CLI: help that teaches, and bad input refused with the right exit code before anything
is booted or changed."""

from __future__ import annotations

import pytest

from tests.tools.test_cli import capsule

pytestmark = pytest.mark.tools


def test_update_help_teaches(tmp_path):
    r = capsule(tmp_path, "update", "--help")
    assert r.returncode == 0 and "make" in r.stdout and "apply" in r.stdout
    r = capsule(tmp_path, "update", "make", "--help")
    assert r.returncode == 0
    for needle in ("--install", "--upgrade", "--run", "--name", "tmpfs", "capsule update make web --install jq"):
        assert needle in r.stdout
    r = capsule(tmp_path, "update", "apply", "--help")
    assert r.returncode == 0 and "--restart" in r.stdout and "capsule update apply alice --system web@4" in r.stdout
    r = capsule(tmp_path, "create", "--help")
    assert "--data-disk" in r.stdout


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["update", "make", "web", "--install", "jq;reboot"], 2, "not Debian package names"),
    (["update", "make", "web"], 2, "nothing to do"),
    (["update", "make", "ghost", "--install", "jq"], 3, "no capsule named 'ghost'"),
    (["update", "apply", "ghost", "--system", "web@1"], 3, "no capsule named 'ghost'"),
    (["update", "apply", "ghost@2", "--system", "web@1"], 2, "give the capsule as NAME"),
    (["create", "c", "--image", "x", "--data-disk", "100k"], 2, "data disk size '100k' out of range"),
])
def test_update_errors(tmp_path, args, code, needle):
    r = capsule(tmp_path, *args)
    assert r.returncode == code, r.stderr
    assert needle in " ".join(r.stderr.split())
