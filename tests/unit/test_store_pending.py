"""gc and a push in flight: objects received for a version that is not recorded yet are
pending; gc keeps them (and their ancestors) for a while, recording the version releases
them, and recording checks its objects under the store lock."""

from __future__ import annotations

import threading
import time

import pytest

from capsule import hierarchy
from capsule.errors import NotFound
from capsule.store import Store
from capsule.store.objectio import has_object
from capsule.transfer.records import record_version
from tests.helpers.received import receive_file, receive_layer, record_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "store")
    yield s
    s.close()


def _received(store, work):
    """What a push of one version leaves before its version is recorded: a layer, a kernel, an initrd."""
    work.mkdir(exist_ok=True)
    return receive_layer(store, work, 1), receive_file(store, work, 2, "kernel"), receive_file(store, work, 3, "initrd")


def test_received_objects_survive_gc_until_their_version_is_recorded(store, tmp_path):
    lid, kernel, initrd = _received(store, tmp_path / "w")
    assert {(p.kind, p.id) for p in store.catalogue.pending()} == {("layer", lid), ("file", kernel),
                                                                    ("file", initrd)}
    r = hierarchy.gc(store)
    assert r.layers == [] and r.files == []
    assert sorted(r.pending) == sorted([lid, kernel, initrd])
    assert has_object(store, "layer", lid) and has_object(store, "file", kernel) and has_object(store, "file", initrd)

    _row, created = record_version(store, record_of("cap", 1, [lid], kernel, initrd))
    assert created
    assert store.catalogue.pending() == []
    r = hierarchy.gc(store)
    assert r.layers == [] and r.files == [] and r.pending == []
    assert has_object(store, "layer", lid)


def test_pending_objects_older_than_the_age_are_collected(store, tmp_path, monkeypatch):
    lid, kernel, initrd = _received(store, tmp_path / "w")
    long_ago = time.time() - hierarchy.DEFAULT_PENDING_MAX_AGE - 60
    store.catalogue.add_pending("layer", lid, added=long_ago)  # a push that died a day ago
    r = hierarchy.gc(store)
    assert r.layers == [lid] and r.pending_expired == [lid]
    assert not has_object(store, "layer", lid) and not store.layer_path(lid).exists()
    assert has_object(store, "file", kernel)          # still young
    assert {p.id for p in store.catalogue.pending()} == {kernel, initrd}

    monkeypatch.setenv("CAPSULE_PENDING_MAX_AGE", "0")  # configurable: nothing is young any more
    r = hierarchy.gc(store)
    assert sorted(r.files) == sorted([kernel, initrd]) and store.catalogue.pending() == []


def test_a_pending_layer_keeps_its_ancestors_and_an_explicit_drop_releases_it(store, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    parent = receive_layer(store, work, 10)
    child = receive_layer(store, work, 11, parent=parent)
    assert hierarchy.drop_pending(store, [parent]) == [parent]  # the parent alone belongs to nothing now
    r = hierarchy.gc(store)
    assert r.layers == [] and r.pending == [child]
    assert has_object(store, "layer", parent)        # the pending child stands on it

    assert hierarchy.drop_pending(store) == [child]
    r = hierarchy.gc(store)
    assert sorted(r.layers) == sorted([parent, child])
    assert not has_object(store, "layer", parent) and not has_object(store, "layer", child)


def test_dry_run_keeps_the_pending_set(store, tmp_path):
    lid, _kernel, _initrd = _received(store, tmp_path / "w")
    store.catalogue.add_pending("layer", lid, added=0.0)
    r = hierarchy.gc(store, dry_run=True)
    assert r.layers == [lid] and r.pending_expired == [lid]
    assert has_object(store, "layer", lid) and lid in {p.id for p in store.catalogue.pending()}


def test_recording_a_version_with_a_missing_object_fails_and_records_nothing(store, tmp_path):
    lid, kernel, _initrd = _received(store, tmp_path / "w")
    with pytest.raises(NotFound, match="initrd .* has not arrived"):
        record_version(store, record_of("cap", 1, [lid], kernel, "e" * 64))
    assert store.catalogue.version("cap", 1) is None and store.catalogue.capsule("cap") is None
    assert len(store.catalogue.pending()) == 3       # still protected: the push may go on


def test_objects_are_checked_under_the_lock(tmp_path):
    """gc (here: another Store object, as in another process) removes an object while
    record_version waits for the lock: the version must not be recorded without it."""
    a = Store.open(tmp_path / "store")
    b = Store.open(tmp_path / "store")
    try:
        lid, kernel, initrd = _received(a, tmp_path / "w")
        held, go = threading.Event(), threading.Event()

        def gc_like() -> None:
            with b.lock():
                held.set()
                go.wait(10)
                hierarchy.drop_pending(b, [kernel])
                hierarchy.gc(b)             # re-entrant: the kernel belongs to nothing and goes

        outcome: list[BaseException | tuple] = []

        def recorder() -> None:
            try:
                outcome.append(record_version(a, record_of("cap", 1, [lid], kernel, initrd)))
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                outcome.append(exc)

        t_gc = threading.Thread(target=gc_like)
        t_gc.start()
        assert held.wait(10)
        t_rec = threading.Thread(target=recorder)
        t_rec.start()
        time.sleep(0.3)                     # the recorder is now waiting for the lock (or, before, had checked)
        go.set()
        t_gc.join(10)
        t_rec.join(10)
        assert not t_rec.is_alive() and len(outcome) == 1
        assert isinstance(outcome[0], NotFound), outcome[0]
        assert a.catalogue.version("cap", 1) is None
    finally:
        a.close()
        b.close()
