"""A store made by an older release opens with this one and keeps everything; one made by a newer release is
refused with a message naming both versions, and left as it was.

``tests/data/stores/0.1.0.tar.gz`` was made by ``tests/data/stores/make_store.py`` at release 0.1.0: an
image, two capsules (one version a child layer with a memory image), users, an owner, a token and a host
grant, peers, a fleet member, a backup schedule and a copy."""

from __future__ import annotations

import json
import sqlite3
import tarfile
from pathlib import Path

import pytest

from capsule import __version__, capsules
from capsule.accounts import owners, tokens, users
from capsule.backup import copies, jobs
from capsule.errors import EnvironmentProblem, IntegrityError
from capsule.fleet import members
from capsule.hosts import peers
from capsule.store import STORE_FORMAT, Store
from capsule.store.schema import SCHEMA_VERSION
from capsule.verify import verify

pytestmark = [pytest.mark.tools, pytest.mark.timeout(120)]

DATA = Path(__file__).resolve().parents[1] / "data" / "stores"


def unpack(release: str, into: Path) -> Path:
    with tarfile.open(DATA / f"{release}.tar.gz") as tar:
        tar.extractall(into)          # (our own test data; Python 3.11.2 has no extraction filter)
    return into / "store"


def user_version(home: Path) -> int:
    db = sqlite3.connect(home / "catalogue.sqlite")
    try:
        return db.execute("PRAGMA user_version").fetchone()[0]
    finally:
        db.close()


def test_a_store_of_0_1_0_opens_with_everything_in_it(tmp_path):
    home = unpack("0.1.0", tmp_path)
    assert user_version(home) == 0                      # 0.1.0 had no schema version
    store = Store.open(home)
    try:
        assert user_version(home) == SCHEMA_VERSION
        columns = {r[1] for r in store.catalogue.query("PRAGMA table_info(tokens)")}
        assert {"allow", "capsule", "version", "issuer"} <= columns
        grant = next(t for t in tokens.tokens(store) if t.user == tokens.HOST_USER)
        assert grant.grant is None and grant.state() == "expired"   # 0.1.0's host grants named no capability
        assert {c.name for c in capsules.list_states(store)} == {"desk", "web"}
        desk2 = capsules.resolve(store, "desk@2")
        assert desk2.memory is not None and len(desk2.chains[0]) == 2
        assert capsules.resolve(store, "web@1").chains == desk2.chains
        assert {u.name: u.role for u in users.users(store)} == {"root": "admin", "ann": "owner"}
        assert users.sign_in(store, "root", "correct horse battery") is not None
        assert owners.owner_of(store, "desk") == "ann"
        assert [t.user for t in tokens.tokens(store, "ann")] == ["ann"]
        assert {p.name: p.fingerprint for p in peers(store)} == {"vault": "SHA256:" + "A" * 43, "edge-1": None}
        assert [(m.peer.name, m.group) for m in members.members(store)] == [("edge-1", "edge")]
        job = jobs.get(store, "desk")
        assert (job.calendar, job.target) == ("mon..fri 21:00", "vault")
        assert copies.copied(store, "desk", "vault") == {2}
        report = verify(store)
        assert report.ok, report.as_dict()
        assert json.loads((store.home / "store.json").read_text())["format"] == STORE_FORMAT
    finally:
        store.close()
    again = Store.open(home)                             # a second open changes nothing
    again.close()
    assert user_version(home) == SCHEMA_VERSION


def test_a_catalogue_of_a_newer_release_is_refused_and_left_alone(tmp_path):
    home = unpack("0.1.0", tmp_path)
    Store.open(home).close()
    db = sqlite3.connect(home / "catalogue.sqlite")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(EnvironmentProblem) as err:
        Store.open(home)
    assert f"schema {SCHEMA_VERSION + 1}" in str(err.value) and f"up to {SCHEMA_VERSION}" in str(err.value)
    assert user_version(home) == SCHEMA_VERSION + 1


def test_a_failing_migration_changes_nothing(tmp_path, monkeypatch):
    from capsule.store import schema

    home = unpack("0.1.0", tmp_path)

    def broken(db):
        db.execute("CREATE TABLE half_done(x)")
        raise RuntimeError("disk trouble in the middle of a migration")

    monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS[:1], schema.Migration(2, "broken", broken)))
    with pytest.raises(RuntimeError):
        Store.open(home)
    db = sqlite3.connect(home / "catalogue.sqlite")
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 0
        assert not db.execute("SELECT 1 FROM sqlite_master WHERE name='half_done'").fetchall()
        assert "allow" not in {r[1] for r in db.execute("PRAGMA table_info(tokens)")}
    finally:
        db.close()


def test_a_store_of_a_newer_release_is_refused_and_left_alone(tmp_path):
    home = unpack("0.1.0", tmp_path)
    meta = json.loads((home / "store.json").read_text())
    meta["format"] = STORE_FORMAT + 1
    (home / "store.json").write_text(json.dumps(meta))
    before = {p: p.stat().st_mtime_ns for p in home.rglob("*")}
    with pytest.raises(EnvironmentProblem) as err:
        Store.open(home)
    assert f"store format {STORE_FORMAT + 1}" in str(err.value) and __version__ in str(err.value)
    assert f"up to {STORE_FORMAT}" in str(err.value)
    assert {p: p.stat().st_mtime_ns for p in home.rglob("*")} == before


@pytest.mark.parametrize("bad", ["2", 0, -1, None, True, 1.5])
def test_a_store_format_that_is_not_one_is_refused(tmp_path, bad):
    home = unpack("0.1.0", tmp_path)
    meta = json.loads((home / "store.json").read_text())
    meta["format"] = bad
    (home / "store.json").write_text(json.dumps(meta))
    with pytest.raises(IntegrityError, match="store format"):
        Store.open(home)
