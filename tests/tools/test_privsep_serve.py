"""`capsule serve --user capsule` started as root serves unprivileged (its uid, gid and capabilities read from
/proc) beside one root helper, and refuses a store that is not that user's; root's CLI on such a store runs as
its owner; the helper started as its own process runs debugfs as the sandbox user for the agent."""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from capsule.agent.launch import AgentProcess, serve_command
from capsule.errors import Error
from capsule.privsep.helper import HelperClient
from capsule.runtime.guestaccess import let_pass

pytestmark = [pytest.mark.tools, pytest.mark.timeout(120)]

USER = "capsule"


@pytest.fixture
def user():
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pytest.fail("no user capsule: run `make setup` (scripts/setup-host.sh creates it)")


def status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, v in (ln.split(":", 1) for ln in text.splitlines() if ":" in ln)}


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def owned_store(tmp_path: Path, user: pwd.struct_passwd) -> Path:
    home = tmp_path / "store"
    home.mkdir()
    os.chown(home, user.pw_uid, user.pw_gid)
    let_pass(tmp_path, Path("/tmp"))   # the user passes through the test's private directories
    return home


def test_serve_as_user_runs_unprivileged_beside_one_root_helper(tmp_path, user):
    home = owned_store(tmp_path, user)
    with AgentProcess(home, home / "agent.token", log_path=tmp_path / "agent.log", extra=["--user", USER]) as agent:
        st = status(agent.proc.pid)
        assert st["Uid"].split() == [str(user.pw_uid)] * 4 and st["Gid"].split() == [str(user.pw_gid)] * 4
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(st[cap], 16) == 0, cap
        assert st["NoNewPrivs"] == "1"
        assert set(st["Groups"].split()) == {str(g) for g in os.getgrouplist(USER, user.pw_gid)}
        helpers = [p for p in children(agent.proc.pid) if b"capsule.privsep.helper" in
                   Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(helpers) == 1 and status(helpers[0])["Uid"].split()[0] == "0"
        assert f"running as {USER}" in agent.log()
    strangers = [p for p in home.rglob("*") if p.lstat().st_uid != user.pw_uid]
    assert strangers == [], "everything the agent made is its user's"


def test_serve_as_user_refuses_a_store_it_does_not_own(tmp_path, user):
    home = tmp_path / "store"
    home.mkdir()
    (home / "store.json").write_text("{}")   # root's: a store made before, by root
    let_pass(tmp_path, Path("/tmp"))
    proc = subprocess.run(serve_command(home, "127.0.0.1:1", home / "agent.token", tls=False,
                                        extra=["--user", USER]), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    said = " ".join(proc.stderr.split())   # the console wraps long lines
    assert f"not owned by {USER}" in said and f"chown -R {USER}: {home}" in said
    assert sorted(p.name for p in home.iterdir()) == ["store.json"], "nothing was made"
    proc = subprocess.run(serve_command(home, "127.0.0.1:1", home / "agent.token", tls=False,
                                        extra=["--user", "root"]), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9 and "that is root" in " ".join(proc.stderr.split())


def test_serve_as_user_refuses_a_store_another_user_owns(tmp_path, user):
    """Root's CLI first becomes the store's owner (nobody here); --user capsule then names the real problem."""
    home = tmp_path / "store"
    home.mkdir()
    nobody = pwd.getpwnam("nobody")
    os.chown(home, nobody.pw_uid, nobody.pw_gid)
    let_pass(tmp_path, Path("/tmp"))
    proc = subprocess.run(serve_command(home, "127.0.0.1:1", home / "agent.token", tls=False,
                                        extra=["--user", USER]), capture_output=True, text=True, timeout=60)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 9 and f"not owned by {USER}" in said and f"chown -R {USER}: {home}" in said, said
    assert list(home.iterdir()) == []


def test_root_cli_on_a_users_store_runs_as_that_user(tmp_path, user):
    home = owned_store(tmp_path, user)
    proc = subprocess.run([sys.executable, "-m", "capsule.cli.main", "--home", str(home), "--json", "ls"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
    made = list(home.rglob("*"))
    assert made and all(p.lstat().st_uid == user.pw_uid for p in made), "root's CLI left root-owned files"


def test_the_helper_process_runs_debugfs_as_the_sandbox_user(tmp_path):
    home = tmp_path / "store"
    work = home / "tmp" / "w.sandbox"
    work.mkdir(parents=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(work / "disk.raw"), "4M"], check=True, capture_output=True)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    helper = subprocess.Popen([sys.executable, "-m", "capsule.privsep.helper", str(theirs.fileno()), str(home),
                               "0", "0"], pass_fds=[theirs.fileno()])
    theirs.close()
    try:
        client = HelperClient(ours)
        client.sandbox_hand_over(work / "disk.raw")
        out = tmp_path / "out"
        with out.open("wb") as f:
            code, err = client.run_sandboxed(["debugfs", "-c", "-R", "ls -p /", "disk.raw"], work, f.fileno(),
                                             timeout=60)
        assert code == 0, err
        assert b"/lost+found/" in out.read_bytes()
        with pytest.raises(Error, match="debugfs or e2fsck only"):
            client.run_sandboxed(["id"], work, os.open(os.devnull, os.O_WRONLY), timeout=60)
    finally:
        ours.close()
        helper.wait(10)
    assert helper.returncode == 0, "the helper ends when the agent closes its end"
