"""`capsule backup restore NAME@V --from REPO [--live]`: what it refuses before it touches anything — --live or
--key-file without a repository, a --from that is no repository (a backup host's copy starts with `start --from`)
— each with a message that says what to do, and the store unchanged. The restores themselves run against a real
SeaweedFS cluster: tests/vm/test_repo_instant.py (whole), tests/hosts/test_repo_hosts.py (live)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from capsule.errors import InvalidInput
from capsule.store import Store

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize(("args", "says"), [
    (["--live"], "--live and --key-file restore a backup from a repository: give --from"),
    (["--key-file", "key"], "--live and --key-file restore a backup from a repository: give --from"),
    (["--from", "vault", "--live"], "a backup host's copy starts with `capsule start NAME@V --from HOST`"),
    (["--from", "https://vault:7070"], "a backup restores from a capsule repository"),
])
def test_what_cannot_restore_from_a_repository_is_refused_and_changes_nothing(tmp_path, monkeypatch, args, says):
    from capsule.cli.main import app

    home = tmp_path / "home"
    Store.open(home).close()
    monkeypatch.setenv("CAPSULE_HOME", str(home))
    before = sorted(p.relative_to(home) for p in home.rglob("*"))
    r = CliRunner().invoke(app, ["backup", "restore", "desk@12", *args])
    assert isinstance(r.exception, InvalidInput), r.output
    assert says in str(r.exception) and "nothing was changed" in str(r.exception)
    assert sorted(p.relative_to(home) for p in home.rglob("*")) == before
