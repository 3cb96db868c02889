"""Which layers of a deep chain are folded before a guest starts on it (capsule.lifecycle.chaindepth): never
a chain that libvirt still takes, always enough that the result is shallow, and an old large fold is left
alone while the new layers are small (so a capsule snapshotted every minute does not copy its whole history
again every ten minutes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsule.lifecycle.chaindepth import MAX_DEPTH, RECENT, fold_from

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_a_chain_libvirt_takes_is_left_alone():
    assert fold_from([100] * MAX_DEPTH) is None
    assert fold_from([5]) is None


def test_the_recent_layers_fold_and_an_old_large_fold_stays():
    # an image of 90,000 blocks, an earlier fold of 50,000, then nineteen snapshots of a few hundred each
    blocks = [90_000, 50_000, *[300] * 9, 4_000, *[300] * 9]
    k = fold_from(blocks)
    assert k == 2 and blocks[k - 1] > sum(blocks[k:])


def test_small_layers_below_the_recent_ones_are_taken_with_them():
    blocks = [90_000, *[10] * 25]
    k = fold_from(blocks)
    assert k == 1                 # every small layer down to the image: one fold


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=200))
def test_after_a_fold_the_chain_always_has_room_for_recent_snapshots(blocks):
    k = fold_from(blocks)
    if k is None:
        assert len(blocks) <= MAX_DEPTH
        return
    assert 1 <= k <= len(blocks) - RECENT
    assert k + 1 <= MAX_DEPTH - RECENT + 1        # the folded chain, and ten more snapshots before the next fold
