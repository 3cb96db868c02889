"""The CLI maps typed errors to exit codes and prints JSON for scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tools


def capsule(home, *args):
    env = dict(os.environ, CAPSULE_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "capsule.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_help_teaches(tmp_path):
    r = capsule(tmp_path, "--help")
    assert r.returncode == 0
    for verb in ("create", "derive", "start", "suspend", "snapshot", "promote", "verify", "tree", "image"):
        assert verb in r.stdout


def test_version_is_the_package_version(tmp_path):
    from capsule import __version__

    r = capsule(tmp_path, "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"capsule {__version__}"
    assert not (tmp_path / "catalogue.db").exists()        # it opened no store


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["show", "nope"], 3, "no capsule named 'nope'"),
    (["show", "bad name"], 2, "invalid capsule name"),
    (["show", "x@0"], 2, "invalid version"),
    (["rm", "../../etc"], 2, "invalid capsule name"),
    (["create", "c", "--image", "missing"], 3, "no image named 'missing'"),
    (["create", "c", "--image", "../x"], 2, "invalid image name"),
    (["create", "c", "--image", "x", "--memory", "lots"], 2, "invalid size"),
    (["start", "ghost"], 3, "no capsule named 'ghost'"),
    (["suspend", "ghost"], 3, "no capsule named 'ghost'"),
    (["image", "build", "windows", "w"], 2, "unknown image kind"),
])
def test_errors_have_exit_codes_and_messages(tmp_path, args, code, needle):
    r = capsule(tmp_path, *args)
    assert r.returncode == code, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_json_output(tmp_path):
    home = tmp_path / "store"
    r = capsule(home, "ls", "--json")
    assert r.returncode == 0
    assert json.loads(r.stdout) == []
    r = capsule(home, "--json", "gc")
    assert json.loads(r.stdout)["freed_bytes"] == 0
    r = capsule(home, "verify", "--json")
    assert json.loads(r.stdout) == {"ok": True, "layers": 0, "files": 0, "problems": []}


def test_verify_names_loose_modes_and_fix_modes_repairs_them(tmp_path):
    home = tmp_path / "store"
    assert capsule(home, "ls").returncode == 0          # creates the store
    os.chmod(home / "files", 0o755)
    r = capsule(home, "verify", "--json")
    assert r.returncode == 6
    [problem] = json.loads(r.stdout)["problems"]
    # files/ is 0710: QEMU's group passes through it to a guest's kernel and initrd (runtime/guestaccess.py)
    assert problem["kind"] == "mode" and problem["id"] == str(home / "files") and "expected 0710" in problem["error"]
    r = capsule(home, "verify", "--fix-modes", "--json")
    assert r.returncode == 0, r.stdout
    assert json.loads(r.stdout)["fixed_modes"] == [str(home / "files")]
    assert os.stat(home / "files").st_mode & 0o777 == 0o710


def test_gc_drop_pending_collects_abandoned_received_objects(tmp_path):
    from capsule.store import Store
    from tests.helpers.received import receive_file

    home = tmp_path / "store"
    work = tmp_path / "w"
    work.mkdir()
    store = Store.open(home)
    fid = receive_file(store, work, 7, "kernel")
    store.close()
    r = capsule(home, "--json", "gc")
    assert json.loads(r.stdout)["pending"] == [fid] and json.loads(r.stdout)["files"] == []
    r = capsule(home, "--json", "gc", "--drop-pending")
    assert json.loads(r.stdout)["files"] == [fid]
    assert not (home / "files" / fid).exists()


def test_tree_prints_the_graph_the_dashboard_draws(tmp_path):
    """`capsule tree --json` is views.tree_dict (GET /api/tree answers the same); the text view draws it."""
    import time

    from capsule import capsules, views
    from capsule.store import Store
    from capsule.store.catalogue import ImageRow, LayerRow

    home = tmp_path / "store"
    store = Store.open(home)
    root, child = "a1" * 32, "b2" * 32
    store.catalogue.add_layer(LayerRow(root, None, 1 << 30, 5 << 20, 4 << 20, 1024, time.time()))
    store.catalogue.add_layer(LayerRow(child, root, 1 << 30, 70 << 10, 64 << 10, 16, time.time()))
    store.catalogue.add_image(ImageRow("img", "tiny", root, "k" * 64, "i" * 64, "", "", {}, time.time()))
    capsules.create(store, "desk", "img", memory="256M")
    capsules.derive(store, "desk", "kid")
    expected = views.tree_dict(store)
    store.close()
    r = capsule(home, "tree", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == expected
    assert [x["id"] for x in expected["layers"]] == [root, child]
    assert sorted(v["ref"] for v in expected["versions"]) == ["desk@1", "kid@1"]
    r = capsule(home, "tree")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    (line,) = [x for x in lines if root[:12] in x]
    assert "image img" in line and "desk@1" in line and "kid@1" in line and "4.0 MiB" in line
    (sub,) = [x for x in lines if child[:12] in x]
    assert lines.index(sub) > lines.index(line) and sub.index(child[:12]) > line.index(root[:12])  # drawn under it
