"""Names, ids and the store without guests: malformed input gets a clear,
typed error and touches nothing."""

from __future__ import annotations

import pytest

from capsule.errors import InvalidName, SealedObjectError
from capsule.names import check_name, check_object_id, parse_ref
from capsule.store import Store
from capsule.units import parse_memory_mib, parse_size

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bad", ["", "-x", ".hidden", "a/b", "../etc", "a b", "x" * 64, "é", "a..b", "a@1@2"])
def test_bad_names_are_refused(bad):
    with pytest.raises(InvalidName):
        parse_ref(bad)


@pytest.mark.parametrize("bad", ["a@0", "a@-1", "a@x", "a@", "a@1.5", "a@99999999999"])
def test_bad_versions_are_refused(bad):
    with pytest.raises(InvalidName):
        parse_ref(bad)


def test_good_refs():
    assert parse_ref("alice-desktop") .version is None
    r = parse_ref("alice-desktop@7")
    assert (r.name, r.version, str(r)) == ("alice-desktop", 7, "alice-desktop@7")
    assert check_name("Web_01.v2") == "Web_01.v2"


@pytest.mark.parametrize("bad", ["../../etc/passwd", "A" * 64, "0" * 63, "0" * 65, "g" * 64, "0" * 63 + "/"])
def test_object_ids_are_checked(tmp_path, bad):
    store = Store.open(tmp_path / "s")
    with pytest.raises(InvalidName):
        check_object_id(bad)
    with pytest.raises(InvalidName):
        store.layer_path(bad)
    with pytest.raises(InvalidName):
        store.file_path(bad)


def test_sealed_objects_refuse_changes(tmp_path):
    store = Store.open(tmp_path / "s")
    with pytest.raises(SealedObjectError):
        store.assert_mutable(store.layer_path("a" * 64))
    with pytest.raises(SealedObjectError):
        store.assert_mutable(store.file_path("b" * 64))
    store.assert_mutable(store.new_leaf_path())  # leaves are writable


def test_store_id_is_stable(tmp_path):
    a = Store.open(tmp_path / "s")
    b = Store.open(tmp_path / "s")
    assert a.id == b.id and len(a.id) == 8
    assert a.domain_name("x") == f"capsule-{a.id}-x"


def test_sizes():
    assert parse_size("512M") == 512 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("256MiB") == 256 << 20
    assert parse_memory_mib("1G") == 1024
    assert parse_memory_mib("300") == 300
    for bad in ("lots", "-1M", "1X", "10M"):
        with pytest.raises(InvalidName):
            parse_memory_mib(bad)
