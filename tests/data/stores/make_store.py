"""Make the small store that the upgrade test opens: ``python tests/data/stores/make_store.py OUT.tar.gz``.

Run once per release, at that release's revision, with that release's library; the tarball it wrote is
checked in beside it (``0.1.0.tar.gz`` was made at 0.1.0, the revision before the catalogue had a schema
version). Later releases must open it, upgrade it, and find everything below unchanged. It holds a bit
of every table and every kind of object, made through the library's own calls where they need no network
or guest, and by the same SQL those calls write where they do (peers and fleet members are added after
asking the peer, so they are written here as ``capsule host add`` writes them):

- an image (a root layer of real blocks, a kernel and an initrd as file objects);
- capsules ``desk`` (two versions, the second a child layer with a memory image) and ``web`` (derived);
- users ``root`` (admin, password ``correct horse battery``) and ``ann`` (owner of ``desk``), a token of
  ann's, and a host grant (``@host``) of the kind 0.1.0 handed out without an expiry;
- a peer ``vault`` with a pinned fingerprint, a fleet member ``edge-1`` in group ``edge``;
- a backup schedule of ``desk`` to ``vault``, with a policy there, and one copy recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from capsule import capsules
from capsule.accounts import owners, tokens, users
from capsule.backup import copies, jobs
from capsule.backup.retention import Policy
from capsule.fleet import members
from capsule.hosts import _table as peers_table
from capsule.store import Store
from capsule.store.catalogue import ImageRow, VersionRow

MiB = 1 << 20


def _blocks(path: Path, seed: int, count: int) -> None:
    """``count`` 4 KiB blocks of content that names its seed and index (no two alike), then zeros."""
    with open(path, "r+b") as f:
        for i in range(count):
            f.seek(i * 8 * 4096)
            f.write((f"capsule test store {seed} {i} ".encode() * 200)[:4096])


def _layer(store: Store, parent: str | None, seed: int, count: int, work: Path) -> str:
    leaf = store.new_leaf_path()             # beside the layers: the backing is named relative, as sealed
    raw = work / f"raw-{seed}"
    raw.write_bytes(b"")
    os.truncate(raw, 4 * MiB)
    _blocks(raw, seed, count)
    backing = ["-B", store.layer_path(parent).name, "-F", "qcow2"] if parent else []
    subprocess.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=65536", *backing,
                    str(raw), str(leaf)], check=True)
    row = store.seal_layer(leaf, parent)
    store.catalogue.add_layer(row)
    return row.id


def _file(store: Store, role: str, seed: int, work: Path) -> str:
    path = work / f"{role}-{seed}"
    path.write_bytes((f"{role} {seed} ".encode() * 4096)[: 3 * 4096 + 100])
    row = store.seal_file(path, role)
    store.catalogue.add_file(row)
    return row.id


def make(home: Path) -> None:
    store = Store.open(home)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        root = _layer(store, None, 1, 6, work)
        kernel, initrd = _file(store, "kernel", 1, work), _file(store, "initrd", 1, work)
        store.catalogue.add_image(ImageRow(name="img", kind="tiny", root_layer=root, kernel=kernel, initrd=initrd,
                                           cmdline="console=ttyS0", marker="READY", info={}, created=time.time()))
        capsules.create(store, "desk", "img", memory="256M")
        v1 = store.catalogue.version("desk", 1)
        assert v1 is not None
        child = _layer(store, v1.chains[0][-1], 2, 3, work)
        memory = _file(store, "memory", 2, work)
        store.catalogue.add_version(VersionRow(capsule="desk", number=2, parent_capsule="desk", parent_version=1,
                                               memory=memory, chains=[[*v1.chains[0], child]], config=v1.config,
                                               note="suspend", created=time.time()))
        capsules.derive(store, "desk@2", "web", memory=False)
    users.add(store, "root", "admin", "correct horse battery")
    users.add(store, "ann", "owner", "ann's long password")
    owners.set_owner(store, "desk", "ann")
    tokens.create(store, "ann", "read,capsules", 30 * 86400)
    tokens.host_grant(store)
    peers_table(store.catalogue).query(
        "INSERT INTO peers(name, url, token, store_id, added, fingerprint) VALUES(?,?,?,?,?,?)",
        ("vault", "https://vault.example:7070", "vault-token-0123456789abcdef", "0badc0de", time.time(),
         "SHA256:" + "A" * 43))
    peers_table(store.catalogue).query(
        "INSERT INTO peers(name, url, token, store_id, added, fingerprint) VALUES(?,?,?,?,?,?)",
        ("edge-1", "https://edge-1.example:7070", "edge-token-0123456789abcdef", "0edc0de1", time.time(), None))
    members._table(store.catalogue).query("INSERT INTO fleet_members VALUES(?,?,?,?)",
                                          ("edge-1", "edge", time.time(), time.time()))
    jobs.schedule(store, "desk", "mon..fri 21:00", Policy.from_dict({"daily": 7, "weekly": 4}), target="vault",
                  target_policy=Policy.from_dict({"daily": 30}))
    copies._table(store.catalogue).query("INSERT INTO backup_copies(capsule, number, target, copied, wire_bytes) "
                                         "VALUES(?,?,?,?,?)", ("desk", 2, "vault", time.time(), 12345))
    store.close()


def main() -> None:
    out = Path(sys.argv[1]).absolute()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "store"
        make(home)
        for p in (home / "hashcache.bin", home / "hashcache.bin.files"):   # a cache is made anew on demand
            p.unlink(missing_ok=True)
        with tarfile.open(out, "w:gz") as tar:
            tar.add(home, arcname="store", filter=lambda ti: None if ti.name.endswith((".lock", "-wal", "-shm"))
                    else ti)
    print(json.dumps({"wrote": str(out), "bytes": out.stat().st_size}))


if __name__ == "__main__":
    main()
