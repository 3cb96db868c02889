"""update make on a real Debian guest: a small package installed from the machine's Debian source through
the guest agent, sealed as a new version that has it (booted and run), while the new layer holds no .deb and
no apt list file (read with debugfs on the flattened disk, and no block of the layer's own data is one), no
block of the ext4 journal but its superblock (the parent's show through; e2fsck finds the file system clean)
and no systemd journal file; a failing command records nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from capsule import capsules, lifecycle
from capsule.errors import AlreadyExists, Conflict
from capsule.update import make as making
from capsule.update.journal import extents, logical_blocks
from hashcache.qcow2 import ZERO, Qcow2Image
from tests.helpers.guest import run

pytestmark = [pytest.mark.vm, pytest.mark.slow]


def debugfs_ls(raw: Path, path: str) -> list[str]:
    out = subprocess.run(["debugfs", "-R", f"ls -p {path}", str(raw)], capture_output=True, text=True,
                         check=True).stdout
    return [line.split("/")[5] for line in out.splitlines() if line.count("/") >= 6]


def journal_tree(raw: Path) -> dict[str, list[str]]:
    """/var/log/journal's directories and their files (systemd's journal on disk)."""
    tree = {}
    for sub in debugfs_ls(raw, "/var/log/journal"):
        if sub not in (".", ".."):
            tree[sub] = sorted(debugfs_ls(raw, f"/var/log/journal/{sub}"))
    return tree


def own_block_starts(layer: Path) -> set[bytes]:
    """The first 40 bytes of every data block the layer itself holds."""
    starts = set()
    with Qcow2Image(layer) as img:
        for r in img.iter_block_runs():
            if r.kind is ZERO:
                continue
            data = img.read_run(r)
            starts.update(data[i:i + 40] for i in range(0, len(data), 4096))
    return starts


@pytest.mark.timeout(900)
def test_update_make_installs_a_package_and_keeps_apt_out_of_the_layer(debian_store, tmp_path):
    store = debian_store
    capsules.create(store, "web", "debian", memory="512M")
    seen: list[str] = []
    progress: list[str] = []
    res = making.make(store, "web", name="web-jq", install=["jq"], say=progress.append, output=seen.append)

    assert res.version is not None and res.version.ref == "web-jq@2"
    text = "".join(seen)
    assert "Setting up jq" in text and len(seen) > 3, "apt's output came in pieces, as it ran"
    assert [s.exit_code for s in res.steps] == [0, 0]
    assert any(m.startswith("running: apt-get install jq") for m in progress)
    # what apt fetched, measured in its tmpfs, agrees with what it announced (rounded to 4 digits)
    assert res.apt_debs_bytes > 50_000
    assert abs(res.apt_need_to_get - res.apt_debs_bytes) <= res.apt_debs_bytes * 0.01
    assert res.apt_lists_bytes > 1_000_000
    assert res.trimmed_bytes > 0 and res.zero_marks_dropped > 0
    (layer,) = res.layers
    assert layer["data_bytes"] < res.apt_lists_bytes, "the list files are not in the layer"
    assert layer["allocated_bytes"] <= layer["file_bytes"]
    assert layer["zero_blocks"] < 10_000, "the trim's zero marks over zero blocks were dropped"
    assert [v.ref for v in store.catalogue.versions("web")] == ["web@1"]

    top = store.layer_path(res.version.chains[0][-1])
    starts = own_block_starts(top)
    assert not any(s.startswith(b"!<arch>\ndebian-binary") for s in starts), "a .deb's data is in the layer"
    assert not any(s.startswith(b"-----BEGIN PGP SIGNED MESSAGE-----") for s in starts), "an InRelease file"
    raw = tmp_path / "flat.raw"
    subprocess.run(["qemu-img", "convert", "-U", "-O", "raw", str(top), str(raw)], check=True)
    assert set(debugfs_ls(raw, "/var/cache/apt/archives")) <= {".", "..", "partial", "lock"}
    assert set(debugfs_ls(raw, "/var/lib/apt/lists")) <= {".", "..", "partial", "lock"}
    assert set(debugfs_ls(raw, "/var/cache/apt")) <= {".", "..", "archives"}, "no pkgcache.bin either"
    assert "jq" in debugfs_ls(raw, "/usr/bin")
    machine_id = subprocess.run(["debugfs", "-R", "cat /etc/machine-id", str(raw)], capture_output=True,
                                text=True, check=True).stdout
    assert machine_id == "", "each capsule booted from the update makes its own machine id"

    # the ext4 journal: only its superblock is the layer's; its other blocks read as the parent's again,
    # and the flattened disk is a clean file system
    assert res.journal_blocks_dropped > 0
    stat8 = subprocess.run(["debugfs", "-R", "stat <8>", str(raw)], capture_output=True, text=True,
                           check=True).stdout
    jblocks = logical_blocks(extents(stat8))
    assert len(jblocks) > 1000
    own = {i for i, _z, _h in store.layer_manifest(layer["id"]).records()}
    assert own & set(jblocks) == {jblocks[0]}, "the journal's superblock only"
    parent_raw = tmp_path / "parent.raw"
    subprocess.run(["qemu-img", "convert", "-U", "-O", "raw", str(store.layer_path(res.base.chains[0][-1])),
                    str(parent_raw)], check=True)
    with open(raw, "rb") as new, open(parent_raw, "rb") as old:
        for b in jblocks[1:]:
            new.seek(b * 4096)
            old.seek(b * 4096)
            assert new.read(4096) == old.read(4096), f"journal block {b} is not the parent's"
    fsck = subprocess.run(["e2fsck", "-fn", str(raw)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    # systemd's journal stayed in the guest's RAM: /var/log/journal is as the parent had it
    assert journal_tree(raw) == journal_tree(parent_raw)

    lifecycle.start(store, "web-jq@2", timeout=300)
    assert run(store, "web-jq", "jq -n '[1,2,3] | add'") == "6"
    assert run(store, "web-jq", "ls /var/lib/apt/lists | grep -c _Packages || true") == "0"
    with pytest.raises(AlreadyExists, match="already exists"):
        making.make(store, "web", name="web-jq", install=["tree"])


@pytest.mark.timeout(600)
def test_a_failing_command_records_nothing(debian_store):
    store = debian_store
    capsules.create(store, "web", "debian", memory="512M")
    seen: list[str] = []
    with pytest.raises(making.StepFailed, match="exit 3"):
        making.make(store, "web", name="web-bad", run=["echo partial > /root/x; echo about to fail; exit 3"],
                    network=False, output=seen.append)
    assert "about to fail" in "".join(seen)
    assert store.catalogue.capsule("web-bad") is None
    assert store.catalogue.instances() == []
    assert [v.ref for v in store.catalogue.versions()] == ["web@1"]
    assert not list(store.layers_dir.glob("leaf-*")), "the run's leaf was dropped"


def test_an_update_run_is_never_saved_with_its_nic(store):
    capsules.create(store, "t", "tiny", memory="256M")
    lifecycle.start(store, "t", network=making.NETWORK)
    assert "eth0" in run(store, "t", "ls /sys/class/net")
    with pytest.raises(Conflict, match="NIC for `capsule update make`"):
        lifecycle.suspend(store, "t")
    assert store.catalogue.instance("t") is not None
    lifecycle.stop(store, "t", force=True)
    lifecycle.start(store, "t")
    assert "eth0" not in run(store, "t", "ls /sys/class/net"), "other runs have no NIC"
    lifecycle.suspend(store, "t")
