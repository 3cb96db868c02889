"""The map the disk server's native read path serves from (diskserver/chain/fastmap.py), in process: its
shared read-ahead state follows the plugin's own heuristic (fetch.py) request for request."""

from __future__ import annotations

import random
from array import array
from collections import deque
from types import SimpleNamespace

import pytest

from diskserver.chain import ReadaheadSpec
from diskserver.chain.fastmap import FastMap
from diskserver.chain.fetch import Fetching

pytestmark = pytest.mark.unit


def _chain_like(ra: ReadaheadSpec) -> SimpleNamespace:
    return SimpleNamespace(spec=SimpleNamespace(readahead=ra), size=1 << 30, nblocks=1 << 18, layers=[],
                           _seg_start=array("q", [0]), _seg_owner=array("h", [-1]), _seg_host=array("q", [0]),
                           _fastmap=None, _ra_ends=deque(maxlen=8), _ra_window=0)


@pytest.mark.parametrize("ra", [ReadaheadSpec(4, 256), ReadaheadSpec(0, 8), ReadaheadSpec(0, 0)])
def test_the_shared_read_ahead_state_follows_the_plugins_heuristic(tmp_path, ra):
    """FastMap.note (the state the filter's hits advance too) gives the windows fetch.py's own gives."""
    rng = random.Random(7)
    plain, shared = _chain_like(ra), _chain_like(ra)
    shared._fastmap = FastMap.write(tmp_path / "m.fastmap", shared)
    try:
        end = 0
        for _ in range(2000):
            first = end if rng.random() < 0.6 else rng.randrange(1 << 18)
            end = first + rng.randrange(1, 64)
            assert Fetching._note_request(shared, first, end) == Fetching._note_request(plain, first, end)
    finally:
        shared._fastmap.close()
    assert not (tmp_path / "m.fastmap").exists()
