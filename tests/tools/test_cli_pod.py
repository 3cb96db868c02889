"""`capsule pod …`: malformed names and addresses, unknown capsules and pod images give typed errors
with their exit codes before any guest is asked; --json for scripts; help that names every verb."""

from __future__ import annotations

import json

import pytest

from tests.tools.test_cli import capsule

pytestmark = pytest.mark.tools


def test_pod_help_names_every_verb(tmp_path):
    r = capsule(tmp_path, "pod", "--help")
    assert r.returncode == 0
    for verb in ("create", "exec", "ls", "freeze", "thaw", "kill", "checkpoint", "restore", "migrate"):
        assert verb in r.stdout


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["pod", "exec", "noslash", "--", "true"], 2, "CAPSULE/POD"),
    (["pod", "exec", "ghost/web", "--", "true"], 3, "no capsule 'ghost'"),
    (["pod", "freeze", "ghost/Web"], 2, "pod name 'Web'"),
    (["pod", "kill", "bad name/web"], 2, "invalid capsule name"),
    (["pod", "create", "ghost", "web", "--ip", "198.18.0.1/24", "--", "sleep", "9"], 5, "bridge's own address"),
    (["pod", "create", "ghost", "web", "--ip", "198.18.0.0/24", "--", "sleep", "9"], 2, "not a host address"),
    (["pod", "create", "ghost", "web", "--", "sleep", "9"], 3, "no capsule 'ghost'"),
    (["pod", "restore", "zzz", "--to", "ghost"], 2, "at least 6 hex digits"),
    (["pod", "restore", "abcdef12", "--to", "ghost"], 3, "no pod image 'abcdef12'"),
    (["pod", "checkpoint", "ghost/web"], 3, "no capsule 'ghost'"),
    (["pod", "migrate", "ghost/web", "--to", "ghost"], 2, "already"),
    (["pod", "migrate", "ghost/web", "--to", "other"], 3, "no capsule 'ghost'"),
])
def test_pod_errors_have_exit_codes_and_messages(tmp_path, args, code, needle):
    r = capsule(tmp_path, *args)
    assert r.returncode == code, r.stderr
    assert needle in r.stderr.replace("\n", " ")
    assert "Traceback" not in r.stderr


def test_pod_ls_json_with_nothing_running(tmp_path):
    r = capsule(tmp_path, "pod", "ls", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
