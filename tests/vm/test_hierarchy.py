"""derive / promote / rm / gc on real guests: every remaining capsule stays
bootable and reads byte-identical data."""

from __future__ import annotations

import pytest

from capsule import capsules, hierarchy, lifecycle
from capsule.errors import Conflict
from capsule.verify import verify
from tests.helpers.guest import disk_digest, write_blocks

pytestmark = pytest.mark.vm


def _run_and_write(store, ref: str, seek: int, count: int) -> str:
    lifecycle.start(store, ref)
    name = ref.split("@")[0]
    write_blocks(store, name, seek, count)
    digest = disk_digest(store, name)
    lifecycle.stop(store, name, force=True)
    return digest


def _boot_digest(store, name: str) -> str:
    lifecycle.start(store, name)
    digest = disk_digest(store, name)
    result = lifecycle.stop(store, name, force=True)
    assert result.version is None  # reading wrote nothing
    return digest


def test_derive_promote_rm_gc_keep_data_identical(store):
    capsules.create(store, "a", "tiny", memory="256M")
    digest_a = _run_and_write(store, "a", 10, 8)
    a_chain = store.catalogue.latest_version("a").chains[0]
    assert len(a_chain) == 2
    a_layer = a_chain[-1]

    capsules.derive(store, "a", "b")
    capsules.derive(store, "a", "c")
    digest_b = _run_and_write(store, "b", 200, 4)
    digest_c = _run_and_write(store, "c", 300, 4)
    assert len({digest_a, digest_b, digest_c}) == 3
    # children share the parent's layers: only their own writes are new
    b_chain = store.catalogue.latest_version("b").chains[0]
    assert b_chain[:2] == a_chain and store.catalogue.layer(b_chain[-1]).blocks == 4

    # promote b: its latest layer absorbs a's layer
    r = hierarchy.promote(store, "b")
    assert len(r.after) == 2 and a_layer not in r.after
    assert store.catalogue.layer(r.after[-1]).blocks == 12
    assert _boot_digest(store, "b") == digest_b

    # the derived-but-never-run versions end in a's layer: removing them needs no folding
    hierarchy.rm(store, "b@1")
    hierarchy.rm(store, "c@1")

    # c@2 still builds on a's layer: rm a is refused and changes nothing
    before = [v.ref for v in store.catalogue.versions()]
    with pytest.raises(Conflict, match="c@2"):
        hierarchy.rm(store, "a")
    assert [v.ref for v in store.catalogue.versions()] == before
    assert store.layer_path(a_layer).exists()

    removed = hierarchy.rm(store, "a", promote_dependants=True)
    assert sorted(removed.removed) == ["a@1", "a@2"]
    assert removed.promoted >= 1
    assert store.catalogue.capsule("a") is None
    assert not store.layer_path(a_layer).exists()  # collected
    assert a_layer not in store.catalogue.latest_version("c").chains[0]

    report = verify(store)
    assert report.ok, report.problems
    assert _boot_digest(store, "b") == digest_b
    assert _boot_digest(store, "c") == digest_c


def test_rm_refused_while_running_changes_nothing(store):
    capsules.create(store, "r", "tiny", memory="256M")
    lifecycle.start(store, "r")
    with pytest.raises(Conflict, match="running"):
        hierarchy.rm(store, "r")
    with pytest.raises(Conflict, match="running"):
        hierarchy.rm(store, "r@1")
    assert store.catalogue.capsule("r") is not None
    assert store.catalogue.instance("r") is not None


def test_gc_keeps_everything_in_use_and_removes_orphans(store):
    capsules.create(store, "g", "tiny", memory="256M")
    _run_and_write(store, "g", 5, 2)
    lifecycle.start(store, "g")
    lifecycle.suspend(store, "g")
    # an orphan object the catalogue never recorded (as after a crash)
    orphan = store.layers_dir / ("f" * 64 + ".qcow2")
    orphan.write_bytes(b"junk")
    result = hierarchy.gc(store)
    assert "f" * 64 in result.layers and not orphan.exists()
    assert verify(store).ok
    lifecycle.start(store, "g")  # still restorable
