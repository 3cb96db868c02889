"""update apply's rule on a catalogue (no guest): the new version takes the system version's disk 0 and
system config and keeps the capsule's data disks, memory and CPUs; a system not derived from the current
one (another base, older, the same) is refused by name and changes nothing."""

from __future__ import annotations

import time

import pytest

from capsule import capsules, views
from capsule.errors import InvalidName
from capsule.store import Store
from capsule.store.catalogue import ImageRow, LayerRow, VersionRow
from capsule.update.apply import NotDerived, apply, current_system

pytestmark = pytest.mark.unit

ROOT, L1, L2, A1, D0, D1, OTHER = (c * 64 for c in "1234567")


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "store")
    s.catalogue.add_image(ImageRow(name="deb", kind="debian", root_layer=ROOT, kernel="8" * 64,
                                   initrd="9" * 64, cmdline="root=/dev/vda", marker="READY", info={},
                                   created=time.time()))
    capsules.create(s, "web", "deb", memory="256M")
    add(s, "web", 2, [[ROOT, L1]], kernel="a" * 64)
    add(s, "web", 3, [[ROOT, L1, L2]], kernel="b" * 64)
    capsules.create(s, "alice", "deb", memory="1G", cpus=2)
    add(s, "alice", 2, [[ROOT, A1], [D0, D1]])          # alice wrote on vda, and has a data disk
    capsules.create(s, "other", "deb")
    add(s, "other", 2, [[OTHER, L1]])
    yield s
    s.close()


def add(store: Store, name: str, number: int, chains: list[list[str]], **config: str) -> VersionRow:
    base = store.catalogue.latest_version(name)
    assert base is not None
    v = VersionRow(capsule=name, number=number, parent_capsule=name, parent_version=base.number, memory=None,
                   chains=chains, config={**base.config, **config}, note="", created=time.time())
    store.catalogue.add_version(v)
    return v


def refs(store: Store, name: str) -> list[str]:
    return [v.ref for v in store.catalogue.versions(name)]


def test_apply_takes_the_system_disk_and_keeps_data_disks_and_config(store):
    assert current_system(store, store.catalogue.latest_version("alice")) == ([ROOT], "image deb")
    res = apply(store, "alice", "web@2")
    v = res.version
    assert v.ref == "alice@3" and v.parent_version == 2 and v.memory is None
    assert v.chains == [[ROOT, L1], [D0, D1]]
    assert (v.config["memory_mib"], v.config["vcpus"]) == (1024, 2)      # alice's own
    assert v.config["kernel"] == "a" * 64                               # the system's
    assert v.config["system"] == {"ref": "web@2", "chain": [ROOT, L1]}
    assert res.dropped_layers == [A1] and not res.restarted
    for lid, size in ((L1, 2 << 30), (D1, 64 << 20)):
        store.catalogue.add_layer(LayerRow(lid, None, size, 0, 0, 0, time.time()))
    shown = views.version_dict(store, v, progress=False)
    assert shown["system"] == "web@2" and shown["disk_sizes"] == [2 << 30, 64 << 20]
    # the next system builds on the recorded one
    assert apply(store, "alice", "web@3").version.chains == [[ROOT, L1, L2], [D0, D1]]
    assert refs(store, "alice") == ["alice@1", "alice@2", "alice@3", "alice@4"]


def test_a_system_of_another_base_is_refused_and_changes_nothing(store):
    apply(store, "alice", "web@2")
    before = refs(store, "alice")
    with pytest.raises(NotDerived, match=r"other@2 is not derived from alice's current system \(web@2\): "
                                         r"its layer 1 is 777777777777 where web@2 has 111111111111"):
        apply(store, "alice", "other@2")
    assert refs(store, "alice") == before


def test_older_and_same_systems_are_refused(store):
    apply(store, "alice", "web@3")
    with pytest.raises(NotDerived, match="it is older: its system disk lacks layers 333333333333"):
        apply(store, "alice", "web@2")
    with pytest.raises(NotDerived, match="already runs on that system"):
        apply(store, "alice", "web@3")
    assert refs(store, "alice") == ["alice@1", "alice@2", "alice@3"]


def test_bad_names_are_refused(store):
    with pytest.raises(InvalidName, match="version of alice itself"):
        apply(store, "alice", "alice@1")
    with pytest.raises(InvalidName, match="give the capsule as NAME"):
        apply(store, "alice@2", "web@2")
    assert refs(store, "alice") == ["alice@1", "alice@2"]


def test_data_disk_sizes():
    assert capsules.data_disk_size("64M") == 64 << 20
    assert capsules.data_disk_size("1500k") == 2 << 20
    for bad in ("0", "512k", "17T", "big"):
        with pytest.raises(InvalidName):
            capsules.data_disk_size(bad)
