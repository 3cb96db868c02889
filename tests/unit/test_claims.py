"""Claims on capsules (capsule/store/claims.py) and a stop that waits on its guest without the store lock: while one
capsule's guest ignores the shutdown request, the store serves everyone else, and only an operation on that same
capsule is refused, with what is under way. No guest: libvirt's domain is a fake that ignores ACPI."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from capsule import capsules, lifecycle
from capsule.errors import CapsuleBusy, Conflict, InvalidName
from capsule.hierarchy import gc
from capsule.lifecycle import instances
from capsule.store import Store, claims
from capsule.store.catalogue import ImageRow, InstanceRow
from tests.wait import wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "store")
    s.catalogue.add_image(ImageRow(name="img", kind="tiny", root_layer=uuid.uuid4().hex * 2,
                                   kernel=uuid.uuid4().hex * 2, initrd=uuid.uuid4().hex * 2,
                                   cmdline="console=ttyS0", marker="READY", info={}, created=time.time()))
    capsules.create(s, "web", "img", memory="256M")
    capsules.create(s, "db", "img", memory="256M")
    yield s
    s.close()


def test_a_claim_refuses_another_thread_at_once_saying_what_is_under_way_and_ends_with_its_holder(store):
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with claims.claim(store, "web", "stopping"):
            held.set()
            done.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(5)
    t0 = time.monotonic()
    busy = r"capsule 'web' is stopping since \d\d:\d\d:\d\d; try again"
    with pytest.raises(CapsuleBusy, match=busy) as e, claims.claim(store, "web", "starting"):
        pass
    assert time.monotonic() - t0 < 2 and e.value.doing == "stopping" and e.value.http_status == 409
    assert claims.holder(store, "web")["doing"] == "stopping"
    with claims.claim(store, "db", "starting"):       # another capsule: not held up
        assert claims.holder(store, "db")["doing"] == "starting"
    done.set()
    t.join(5)
    assert claims.holder(store, "web") is None and not (claims.busy_dir(store) / "web").exists()
    with claims.claim(store, "web", "starting"):      # free again
        pass


def test_a_claim_is_reentrant_in_its_thread_and_names_leaves_gc_keeps(store):
    leaf = store.new_leaf_path()
    leaf.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(leaf, (old, old))               # old enough for gc to take it, were it not claimed
    with claims.claim(store, "web", "snapshotting") as c:
        with claims.claim(store, "web", "suspending") as inner:   # snapshot → suspend: the same claim
            assert inner is c and claims.holder(store, "web")["doing"] == "snapshotting"
        c.add_leaves([leaf])
        assert claims.leaves_in_flight(store) == {str(leaf)}
        assert leaf.name not in gc(store).leaves and leaf.exists()
    assert claims.leaves_in_flight(store) == set()
    assert leaf.name in gc(store).leaves and not leaf.exists()


def test_a_bad_name_is_refused_and_makes_no_file(store):
    with pytest.raises(InvalidName), claims.claim(store, "../etc", "stopping"):
        pass
    assert not claims.busy_dir(store).exists()


class GuestIgnoringACPI:
    """A libvirt domain whose guest ignores the power button: only ``destroy`` ends it."""

    def __init__(self) -> None:
        self.alive = True
        self.asked = threading.Event()

    def shutdown(self) -> None:
        self.asked.set()

    def destroy(self) -> None:
        self.alive = False


def test_stop_waits_for_the_guest_without_the_store_lock(store, monkeypatch):
    dom = GuestIgnoringACPI()
    monkeypatch.setattr(instances, "lookup_domain", lambda name: dom if dom.alive else None)
    leaf = store.new_leaf_path()
    leaf.write_bytes(b"leaf")
    inst_dir = store.instance_dir("web")
    inst_dir.mkdir()
    with store.catalogue.transaction():
        store.catalogue.add_instance(InstanceRow(capsule="web", version=1, domain=store.domain_name("web"),
                                                 leaves=[str(leaf)], chains=[["a" * 64]], accel="tcg",
                                                 dir=str(inst_dir)))
    result: dict[str, object] = {}

    def stop() -> None:
        try:
            result["r"] = lifecycle.stop(store, "web", timeout=4, discard=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    t = threading.Thread(target=stop)
    t.start()
    assert dom.asked.wait(5)
    # the guest is being waited for: the store is free for everyone else meanwhile
    with store.lock(timeout=1, purpose="another tenant"):
        pass
    child = capsules.derive(store, "db", "db-copy")
    assert child.ref == "db-copy@1"
    # and the same capsule says what is under way
    with pytest.raises(CapsuleBusy, match="capsule 'web' is stopping"):
        lifecycle.stop(store, "web", force=True)
    with pytest.raises(CapsuleBusy, match="capsule 'web' is stopping"):
        lifecycle.start(store, "web")
    assert dom.alive and t.is_alive()
    t.join(10)
    assert "error" not in result, result.get("error")
    assert not dom.alive                       # forced off after the timeout
    assert store.catalogue.instance("web") is None and not leaf.exists()
    wait_until(lambda: claims.holder(store, "web") is None, 2, "the stop's claim to end")
    with pytest.raises(Conflict, match="not running"):
        lifecycle.stop(store, "web")


def test_a_caller_holding_the_store_lock_may_not_wait_on_a_guest(store, monkeypatch):
    dom = GuestIgnoringACPI()
    monkeypatch.setattr(instances, "lookup_domain", lambda name: dom if dom.alive else None)
    inst_dir: Path = store.instance_dir("web")
    inst_dir.mkdir()
    with store.catalogue.transaction():
        store.catalogue.add_instance(InstanceRow(capsule="web", version=1, domain=store.domain_name("web"),
                                                 leaves=[], chains=[["a" * 64]], accel="tcg", dir=str(inst_dir)))
    with store.lock(), pytest.raises(Exception, match="while holding the store lock"):
        lifecycle.stop(store, "web", timeout=0.1, discard=True)
    assert dom.alive and not dom.asked.is_set() and store.catalogue.instance("web") is not None
