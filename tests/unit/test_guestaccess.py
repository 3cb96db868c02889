"""QEMU runs unprivileged: the domain XML names its user with relabelling off, and the store grants that user's
group exactly what a guest opens (``capsule/runtime/guestaccess.py``). Run as root, on real files."""

from __future__ import annotations

import os
import stat
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from capsule.errors import EnvironmentProblem, IntegrityError
from capsule.runtime import guestaccess
from capsule.runtime.domainxml import MachineSpec, build
from capsule.runtime.guestaccess import GuestUser, backing_chain, grant_machine, lend, let_pass
from capsule.runtime.restorexml import check
from capsule.store import Store
from hashcache.qcow2_writer import write_layer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]   # as root, like the whole suite (chown)

GUEST = GuestUser("guest", 64999, 64998)   # ids no file here has: a grant is visible
ROOT = GuestUser("root", 0, 0)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _layer(path: Path, backing: str | None) -> Path:
    write_layer(path, virtual_size=1 << 20, backing=backing, records=[(0, False)], read_block=lambda i: b"x" * 4096)
    return path


@pytest.fixture
def machine(tmp_path):
    """A store with a base layer, a layer on it and a leaf on that, a kernel, an initrd, an instance directory
    and a memory image: the modes a fresh store gives them."""
    store = Store.open(tmp_path / "store")
    base = _layer(store.layers_dir / "base.qcow2", None)
    mid = _layer(store.layers_dir / "mid.qcow2", "base.qcow2")
    leaf = _layer(store.layers_dir / "leaf-1.qcow2", "mid.qcow2")
    for p in (base, mid):
        p.chmod(0o440)
    leaf.chmod(0o660)
    kernel, initrd, memory = (store.files_dir / n for n in ("kernel", "initrd", "memory"))
    for p, mode in ((kernel, 0o440), (initrd, 0o440), (memory, 0o400)):
        p.write_bytes(b"k")
        p.chmod(mode)
    inst = store.instances_dir / "demo"
    inst.mkdir(mode=0o700)
    sock = inst / "disk0.nbd"
    sock.write_bytes(b"")
    sock.chmod(0o660)
    yield store, dict(base=base, mid=mid, leaf=leaf, kernel=kernel, initrd=initrd, memory=memory, inst=inst,
                      sock=sock)
    store.close()


def test_the_domain_names_the_guest_user_and_libvirt_relabels_nothing(monkeypatch):
    monkeypatch.setattr(guestaccess, "guest_user", lambda: GUEST)
    spec = MachineSpec(name="d", uuid="00000000-0000-0000-0000-000000000001", memory_mib=64, vcpus=1, accel="tcg",
                       kernel=Path("/k"), initrd=Path("/i"), cmdline="", disks=[Path("/leaf")],
                       console_log=Path("/c"), agent_socket=Path("/a.sock"))
    dom = ET.fromstring(build(spec))
    labels = dom.findall("seclabel")
    assert len(labels) == 1
    assert labels[0].attrib == {"type": "static", "model": "dac", "relabel": "no"}
    assert labels[0].findtext("label") == "+64999:+64998"
    # a memory image saved with it (libvirt writes the label back as it was given) is restored here and elsewhere
    check("<domain type='qemu'><seclabel type='static' model='dac' relabel='no'><label>+64999:+64998</label>"
          "</seclabel></domain>")


def test_guest_user_is_libvirts_unprivileged_user_unless_named(monkeypatch):
    guestaccess.guest_user.cache_clear()
    try:
        monkeypatch.delenv(guestaccess.USER_ENV, raising=False)
        user = guestaccess.guest_user()
        assert user.name in ("libvirt-qemu", "root")   # root only where libvirt-daemon-system is missing
        if user.name == "libvirt-qemu":
            assert user.uid != 0 and not user.unconfined
        guestaccess.guest_user.cache_clear()
        monkeypatch.setenv(guestaccess.USER_ENV, "no-such-user-here")
        with pytest.raises(EnvironmentProblem, match="no-such-user-here"):
            guestaccess.guest_user()
        guestaccess.guest_user.cache_clear()
        monkeypatch.setenv(guestaccess.USER_ENV, "root")
        assert guestaccess.guest_user().unconfined
    finally:
        guestaccess.guest_user.cache_clear()


def test_backing_chain_is_read_from_the_headers(machine):
    _, m = machine
    assert backing_chain(m["leaf"]) == [m["mid"], m["base"]]
    assert backing_chain(m["base"]) == []


def test_a_backing_loop_is_refused(tmp_path):
    _layer(tmp_path / "a.qcow2", "b.qcow2")
    _layer(tmp_path / "b.qcow2", "a.qcow2")
    with pytest.raises(EnvironmentProblem, match="longer than"):
        backing_chain(tmp_path / "a.qcow2")


def test_a_guest_gets_its_files_and_nothing_else(machine):
    store, m = machine
    grant_machine(store.home, kernel=m["kernel"], initrd=m["initrd"], leaves=[m["leaf"]], instance_dir=m["inst"],
                  sockets=[m["sock"]], user=GUEST)
    g = GUEST.gid
    for d in (store.home, store.layers_dir, store.files_dir, store.instances_dir):
        assert (d.stat().st_gid, _mode(d)) == (g, 0o710), d       # pass through, never list
    assert (m["inst"].stat().st_gid, _mode(m["inst"])) == (g, 0o1770)   # its sockets; sticky: nothing else
    for name in ("base", "mid", "kernel", "initrd"):
        assert (m[name].stat().st_gid, _mode(m[name])) == (g, 0o440), name   # read-only: sealed
    assert (m["leaf"].stat().st_gid, _mode(m["leaf"])) == (g, 0o660)         # the only file it writes
    assert (m["sock"].stat().st_gid, _mode(m["sock"])) == (g, 0o660)
    # RAM and the private directories stay root's alone
    assert (m["memory"].stat().st_gid, _mode(m["memory"])) == (0, 0o400)
    for sub in ("tmp", "recv", "shadows", "remote"):
        assert (store.home / sub).stat().st_gid == 0 and _mode(store.home / sub) == 0o700, sub
    for name in ("catalogue.sqlite", "store.json"):
        assert _mode(store.home / name) == 0o600


def test_root_as_the_guest_user_changes_nothing(machine):
    store, m = machine
    before = {p: (p.stat().st_gid, _mode(p)) for p in (store.home, m["leaf"], m["base"], m["inst"])}
    grant_machine(store.home, kernel=m["kernel"], initrd=m["initrd"], leaves=[m["leaf"]], instance_dir=m["inst"],
                  user=ROOT)
    assert {p: (p.stat().st_gid, _mode(p)) for p in before} == before


def test_a_store_the_guest_user_cannot_reach_is_named_with_the_fix(machine, tmp_path):
    store, m = machine
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    inner = Store.open(private / "store")
    try:
        with pytest.raises(EnvironmentProblem) as exc:
            grant_machine(inner.home, kernel=m["kernel"], initrd=m["initrd"], leaves=[], instance_dir=m["inst"],
                          user=GUEST)
        assert str(private) in str(exc.value) and "chmod o+x" in str(exc.value)
        assert _mode(inner.home) == 0o700           # refused before anything changed
    finally:
        inner.close()


def test_a_lent_file_is_readable_or_writable_as_asked(machine):
    store, m = machine
    grant_machine(store.home, kernel=m["kernel"], initrd=m["initrd"], leaves=[], instance_dir=m["inst"], user=GUEST)
    ro, rw = m["inst"] / "in.raw", m["inst"] / "out.raw"
    for p in (ro, rw):
        p.write_bytes(b"")
        p.chmod(0o600)
    lend(ro, writable=False, user=GUEST)
    lend(rw, writable=True, user=GUEST)
    assert (ro.stat().st_gid, _mode(ro)) == (GUEST.gid, 0o640)
    assert (rw.stat().st_gid, _mode(rw)) == (GUEST.gid, 0o660)
    hidden = store.tmp_dir / "x.raw"   # tmp/ stays private: a file there cannot be lent
    hidden.write_bytes(b"")
    with pytest.raises(EnvironmentProblem, match="tmp"):
        lend(hidden, writable=False, user=GUEST)


def test_let_pass_opens_only_passage_and_only_below_top(tmp_path):
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    for d in (tmp_path / "a", deep):
        d.chmod(0o700)
    let_pass(deep, tmp_path)
    assert _mode(tmp_path / "a") == 0o701 and _mode(deep) == 0o701   # pass through, never list
    with pytest.raises(ValueError):
        let_pass(Path("/etc"), tmp_path)


def test_doctor_says_who_qemu_runs_as_and_whether_it_reaches_the_store(machine, tmp_path, monkeypatch):
    from capsule import doctor

    store, _ = machine
    monkeypatch.setattr(doctor, "guest_user", lambda: GUEST)
    check = doctor._guest_user_check(store)
    assert check.ok and "QEMU runs as guest (uid 64999)" in check.detail
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    hidden = Store.open(private / "store")
    try:
        check = doctor._guest_user_check(hidden)
        assert not check.ok and "cannot reach" in check.detail and str(private) in check.detail
    finally:
        hidden.close()
    monkeypatch.setattr(doctor, "guest_user", lambda: ROOT)
    assert "no confinement" in doctor._guest_user_check(store).detail


def _state(*paths: Path) -> dict[Path, tuple[int, int, int]]:
    return {p: (p.stat().st_uid, p.stat().st_gid, _mode(p)) for p in paths}


@pytest.fixture
def secret(tmp_path):
    """A root-only file outside the store (standing in for /etc/shadow)."""
    (tmp_path / "etc").mkdir()
    path = tmp_path / "etc" / "shadow"
    path.write_bytes(b"root:secret\n")
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("how", ["absolute", "dotdot", "link", "memory", "catalogue"])
def test_a_leaf_naming_a_file_outside_the_stores_layers_is_refused_and_nothing_changes(machine, secret, how):
    """A leaf's header is QEMU's to write: whatever it names outside layers/ is never granted to the guest."""
    store, m = machine
    leaf = store.layers_dir / "leaf-2.qcow2"
    if how == "absolute":
        backing = str(secret)
    elif how == "dotdot":
        backing = os.path.relpath(secret, store.layers_dir)
    elif how == "link":
        (store.layers_dir / "evil.qcow2").symlink_to(secret)
        backing = "evil.qcow2"
    elif how == "memory":
        backing = "../files/memory"
    else:
        backing = "../catalogue.sqlite"
    _layer(leaf, backing)
    leaf.chmod(0o660)
    watched = (secret, m["memory"], store.home / "catalogue.sqlite", store.home, store.layers_dir, m["base"],
               m["kernel"], m["inst"], leaf)
    before = _state(*watched)
    with pytest.raises(IntegrityError, match="not a layer in"):
        grant_machine(store.home, kernel=m["kernel"], initrd=m["initrd"], leaves=[leaf], instance_dir=m["inst"],
                      user=GUEST)
    assert _state(*watched) == before       # refused before anything was granted
    assert secret.read_bytes() == b"root:secret\n"


def test_backing_chain_refuses_a_system_file(tmp_path):
    leaf = _layer(tmp_path / "leaf.qcow2", "/etc/passwd")
    with pytest.raises(IntegrityError, match="'/etc/passwd'"):
        backing_chain(leaf)


def test_the_chain_the_catalogue_knows_is_what_is_granted(machine):
    """A header naming another layer of the store (not one of this disk's chain) is refused; the chain the
    catalogue lists goes through."""
    store, m = machine
    other = _layer(store.layers_dir / "other.qcow2", None)
    other.chmod(0o440)
    leaf = _layer(store.layers_dir / "leaf-3.qcow2", "other.qcow2")
    before = _state(other, store.home)
    with pytest.raises(IntegrityError, match="not a layer of its disk in the catalogue"):
        grant_machine(store.home, kernel=m["kernel"], initrd=m["initrd"], leaves=[leaf], instance_dir=m["inst"],
                      user=GUEST, chains=[[m["mid"], m["base"]]])
    assert _state(other, store.home) == before
    grant_machine(store.home, kernel=m["kernel"], initrd=m["initrd"], leaves=[m["leaf"]], instance_dir=m["inst"],
                  user=GUEST, chains=[[m["mid"], m["base"]]])
    assert (m["mid"].stat().st_gid, m["base"].stat().st_gid) == (GUEST.gid, GUEST.gid)
    assert other.stat().st_gid == 0
