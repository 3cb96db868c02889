"""A capsule snapshotted again and again keeps running: a version whose backing chain is deeper than libvirt
takes (27 layers fail with "failed to parse JSON: nesting too deep") starts on a folded, shallow chain that
reads the same bytes, the version itself is left as it was, and a snapshot of the running guest restores."""

from __future__ import annotations

import subprocess
import time

import pytest

from capsule import capsules, lifecycle, qemuimg
from capsule.lifecycle.chaindepth import MAX_DEPTH
from capsule.store.catalogue import VersionRow

pytestmark = [pytest.mark.vm, pytest.mark.timeout(400)]

LAYERS = 26


def _deep_version(store) -> VersionRow:
    """Version 2 of capsule ``deep``: the tiny image's disk and 26 layers over it, each writing a block of its
    own pattern (and the 26th rewriting the first's)."""
    capsules.create(store, "deep", "tiny", memory="256M")
    v = store.catalogue.latest_version("deep")
    chain = list(v.chains[0])
    for i in range(LAYERS):
        leaf = store.new_leaf_path()
        qemuimg.create_leaf(leaf, store.layer_path(chain[-1]))
        offset = (i % (LAYERS - 1)) * 65536
        subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -q -P {i + 1} {offset} 4096", str(leaf)],
                       check=True, capture_output=True)
        row = store.seal_layer(leaf, chain[-1])
        store.catalogue.add_layer(row)
        chain.append(row.id)
    deep = VersionRow("deep", v.number + 1, "deep", v.number, None, [chain], v.config, "deep", time.time())
    store.catalogue.add_version(deep)
    return deep


def test_a_chain_deeper_than_libvirt_takes_starts_folded_and_snapshots(store):
    deep = _deep_version(store)
    assert len(deep.chains[0]) > MAX_DEPTH + 5
    said: list[str] = []
    lifecycle.start(store, deep.ref, say=said.append)
    try:
        inst = store.catalogue.instance("deep")
        running = inst.chains[0]
        assert len(running) <= MAX_DEPTH and running[0] == deep.chains[0][0]
        assert any("folding the newest" in m for m in said)
        # the fold reads as the deep chain's top does, byte for byte
        same = subprocess.run(["qemu-img", "compare", "-q", "-f", "qcow2", "-F", "qcow2",
                               str(store.layer_path(deep.chains[0][-1])), str(store.layer_path(running[-1]))])
        assert same.returncode == 0
        assert store.catalogue.version("deep", deep.number).chains == deep.chains     # the version is unchanged
        sealed, _resumed = lifecycle.snapshot(store, "deep")
        assert sealed.version is not None and sealed.version.chains[0][:len(running)] == running
        assert store.catalogue.instance("deep") is not None
    finally:
        lifecycle.stop(store, "deep", force=True)
