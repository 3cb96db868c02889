"""The agent's localizer (capsule/lifecycle/localizer.py): a remote layer whose blocks have all arrived becomes
an ordinary local layer with nobody running `capsule localize`, and the source's secret leaves the host; an
incomplete layer waits; a wrong block in a shadow fails the round, is logged, and the layer stays remote until
a later round finds it right. Without processes: the layer is received into one store and made remote in
another, its shadow filled by hand as a disk server would fill it."""

from __future__ import annotations

import logging
import time

import pytest

from capsule.lifecycle import demand
from capsule.lifecycle.localizer import Localizer
from capsule.repo import pagein
from capsule.store import Store
from capsule.store.objectio import object_manifest
from hashcache.blocks import BLOCK_SIZE
from hashcache.shadow import Shadow
from tests.helpers.locks import lock_held
from tests.helpers.received import layer_blocks, receive_layer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SEED = 7
URL = "s3+http://127.0.0.1:9/bucket/capsules"   # a repository's URL: releasing it removes its secret, no call


@pytest.fixture
def stores(tmp_path):
    source, here = Store.open(tmp_path / "source"), Store.open(tmp_path / "here")
    work = tmp_path / "work"
    work.mkdir()
    lid = receive_layer(source, work, SEED)
    manifest = object_manifest(source, "layer", lid)
    demand.add_remote_layer(here, manifest, URL, "the repository's secret", opener=pagein.OPENER)
    yield source, here, lid, manifest
    source.close()
    here.close()


def _arrive(here: Store, manifest, blocks: dict[int, bytes]) -> None:
    with Shadow(demand.shadow_dir(here) / manifest.digest, manifest.block_count) as shadow:
        shadow.store(sorted(blocks.items()))


def test_a_complete_layer_becomes_local_and_its_secret_leaves(stores):
    source, here, lid, manifest = stores
    blocks = layer_blocks(SEED)
    localizer = Localizer(here, poll=0.05)
    first = dict(list(blocks.items())[:1])
    _arrive(here, manifest, first)
    assert localizer.tick() == [] and demand.is_remote(here, lid)          # one block of two: it waits
    secret = demand.token_path(here, URL)
    assert secret.exists()
    _arrive(here, manifest, blocks)
    localizer.start()
    try:
        deadline = time.monotonic() + 20
        while demand.is_remote(here, lid) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        localizer.stop()
    assert localizer.localized == [lid] and not demand.is_remote(here, lid)
    assert here.layer_path(lid).exists() and object_manifest(here, "layer", lid).digest == lid
    assert not secret.exists()                                  # nothing reads from the repository any more
    assert localizer.tick() == []                               # nothing left: a round does nothing


def test_a_wrong_block_fails_the_round_and_a_later_round_heals(stores, caplog):
    source, here, lid, manifest = stores
    blocks = layer_blocks(SEED)
    wrong = {i: b"\x55" * BLOCK_SIZE for i in blocks}
    _arrive(here, manifest, wrong)                              # complete, but not what the manifest says
    localizer = Localizer(here)
    with caplog.at_level(logging.WARNING, logger="capsule.localizer"):
        assert localizer.tick() == []
    assert localizer.last_error and "localizing remote layers failed" in caplog.text
    assert demand.is_remote(here, lid) and not here.layer_path(lid).exists()
    _arrive(here, manifest, blocks)                             # the right blocks (a disk server fetched again)
    assert localizer.tick() == [lid] and localizer.last_error is None
    assert not demand.is_remote(here, lid)


def test_a_busy_store_leaves_the_round_to_the_next_and_an_incomplete_layer_takes_no_lock(stores, monkeypatch):
    source, here, lid, manifest = stores
    monkeypatch.setattr("capsule.lifecycle.localizer.LOCK_WAIT", 0.2)
    localizer = Localizer(here)
    taken: list[str] = []
    real_lock = here.lock

    def counting_lock(*args, **kw):
        taken.append(kw.get("purpose", ""))
        return real_lock(*args, **kw)

    monkeypatch.setattr(here, "lock", counting_lock)
    assert localizer.tick() == [] and taken == []                # nothing complete: no lock taken
    _arrive(here, manifest, layer_blocks(SEED))
    holder = Store.open(here.home)                              # other work holds the store's lock
    try:
        with lock_held(holder):
            assert localizer.tick() == [] and localizer.last_error is None and demand.is_remote(here, lid)
    finally:
        holder.close()
    assert localizer.tick() == [lid]
