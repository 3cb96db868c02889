"""Versions to roll out without booting a guest, for the fleet's tests and benchmark: a new version of a
capsule whose disk chain gains one layer of ``size`` bytes of seeded random data (what an update's
copy-on-write layer is to the transfer: blocks the receiver has never seen)."""

from __future__ import annotations

import random
import subprocess
import time

from capsule import qemuimg
from capsule.store import Store
from capsule.store.catalogue import VersionRow


def new_version(store: Store, name: str, size: int, seed: int, offset: int = 0,
                base_version: int | None = None, content: bytes | None = None) -> VersionRow:
    """``name``'s next version: the chain of its latest version (or of ``base_version``) plus a layer of
    ``size`` random bytes (or ``content``, when given) written at ``offset`` (a multiple of 4 KiB)."""
    with store.lock():
        cat = store.catalogue
        base = cat.latest_version(name) if base_version is None else cat.version(name, base_version)
        latest = cat.latest_version(name)
        assert base is not None and latest is not None, name
        parent = base.chains[0][-1]
        leaf = store.new_leaf_path()
        qemuimg.create_leaf(leaf, store.layer_path(parent))
        data = store.temp_path(".data")
        data.write_bytes(random.Random(seed).randbytes(size) if content is None else content)
        subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -s {data} {offset} {size}", str(leaf)],
                       check=True, capture_output=True)
        data.unlink()
        row = store.seal_layer(leaf, parent)
        version = VersionRow(capsule=name, number=latest.number + 1, parent_capsule=name, parent_version=base.number,
                             memory=None, chains=[[*base.chains[0], row.id], *base.chains[1:]], config=base.config,
                             note=f"update of {size} bytes", created=time.time())
        with cat.transaction():
            cat.add_layer(row)
            cat.add_version(version)
        return version


def with_memory(store: Store, name: str, data: bytes) -> str:
    """Give ``name`` a new version with ``data`` as its memory image (as a suspend would); its ref."""
    path = store.temp_path(".mem")
    path.write_bytes(data)
    row = store.seal_file(path, "memory")
    v = store.catalogue.latest_version(name)
    assert v is not None
    with store.catalogue.transaction():
        store.catalogue.add_file(row)
        store.catalogue.add_version(VersionRow(name, v.number + 1, None, None, row.id, v.chains, v.config,
                                               "test", time.time()))
    return f"{name}@{v.number + 1}"
