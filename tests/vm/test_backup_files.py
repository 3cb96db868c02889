"""`capsule backup files` on a real Debian guest: a file as it was in each backup, read from the sealed
layers without booting them, while the capsule keeps running; nothing in the store changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from capsule import capsules, lifecycle
from capsule.backup import files, jobs, runner
from capsule.backup.retention import Policy
from capsule.errors import NotFound
from tests.helpers.guest import run

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


def cli(store, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, CAPSULE_HOME=str(store.home))
    return subprocess.run([sys.executable, "-m", "capsule.cli.main", *args], capture_output=True, env=env,
                          timeout=300)


def test_read_a_file_from_each_backup_without_booting(debian_store, tmp_path):
    store = debian_store
    capsules.create(store, "desk", "debian", memory="512M")
    # the image's own version, never booted
    assert cli(store, "backup", "files", "desk@1", "/etc/hostname").stdout == b"capsule-guest\n"

    lifecycle.start(store, "desk", timeout=300)
    jobs.schedule(store, "desk", "daily", Policy(last=10), mode="disk-only")
    run(store, "desk", "mkdir -p /home/ann && echo tuesday > /home/ann/notes.txt && ln -s notes.txt "
                       "/home/ann/latest && sync")
    tuesday = runner.run(store, "desk")
    assert tuesday.ok, tuesday.error
    run(store, "desk", "echo wednesday > /home/ann/notes.txt && touch /home/ann/new && sync")
    wednesday = runner.run(store, "desk")
    assert wednesday.ok, wednesday.error
    before = sorted(p.name for p in store.tmp_dir.iterdir())

    t, w = f"desk@{tuesday.version}", f"desk@{wednesday.version}"
    assert cli(store, "backup", "files", t, "/home/ann/notes.txt").stdout == b"tuesday\n"
    assert cli(store, "backup", "files", w, "/home/ann/latest").stdout == b"wednesday\n"
    saved = tmp_path / "notes-tuesday"
    r = cli(store, "--json", "backup", "files", t, "/home/ann/latest", "--out", str(saved))
    assert r.returncode == 0, r.stderr
    assert saved.read_text() == "tuesday\n"
    assert json.loads(r.stdout) | {"saved_to": None} == {
        "version": t, "path": "/home/ann/notes.txt", "kind": "file", "size": 8, "entries": [], "saved_to": None}

    listed = {e.name for e in files.listing(store, t, "/home/ann").entries}
    assert listed == {"notes.txt", "latest"}
    r = cli(store, "--json", "backup", "files", w, "/home/ann")
    assert r.returncode == 0, r.stderr
    assert {e["name"] for e in json.loads(r.stdout)["entries"]} == {"notes.txt", "latest", "new"}

    # clear errors; the guest kept running the whole time, and no temporary copy is left behind
    r = cli(store, "backup", "files", t, "/home/ann/new")
    assert r.returncode == NotFound.exit_code and b"has no /home/ann/new" in r.stderr
    r = cli(store, "backup", "files", t, "/home/ann", "--out", str(tmp_path / "dir"))
    assert r.returncode == 2 and b"is a directory" in r.stderr and not (tmp_path / "dir").exists()
    r = cli(store, "backup", "files", "desk@99", "/")
    assert r.returncode == NotFound.exit_code
    assert run(store, "desk", "cat /home/ann/notes.txt") == "wednesday"
    assert sorted(p.name for p in store.tmp_dir.iterdir()) == before
