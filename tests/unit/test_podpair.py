"""The pod tests' shared pair (tests/vm/podpair.py) without guests: a test's pods are killed after it, a pair
that cannot be made clean is sent away rather than handed to the next test, and a pair is shut down once no
later test asks for it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.vm import podpair
from tests.vm.podpair import PairNotClean, PodPair

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class _Guests:
    """The pods of each capsule, as ops.ls would list them; ``undying``: pods a kill leaves running."""

    def __init__(self, pods: dict[str, list[str]], undying: frozenset[str] = frozenset()) -> None:
        self.pods = pods
        self.undying = undying
        self.killed: list[str] = []

    def ls(self, store, capsule: str) -> list[dict]:
        return [{"name": p, "state": "running"} for p in self.pods[capsule]]

    def kill(self, store, ref: str) -> dict:
        capsule, pod = ref.split("/")
        self.killed.append(ref)
        if pod not in self.undying:
            self.pods[capsule].remove(pod)
        return {"state": "killed"}


def _pair(monkeypatch, guests: _Guests, disks: int = 1) -> tuple[PodPair, list[str]]:
    closed: list[str] = []
    store = SimpleNamespace(catalogue=SimpleNamespace(instance=lambda name: SimpleNamespace(domain=name)),
                            close=lambda: closed.append("store"))
    monkeypatch.setattr(podpair.ops, "ls", guests.ls)
    monkeypatch.setattr(podpair.ops, "kill", guests.kill)
    monkeypatch.setattr(podpair, "destroy_domains", lambda s: closed.append("domains"))
    monkeypatch.setattr(PodPair, "_disks", lambda self, name: disks)
    pair = PodPair("pa", "pb", pod_network=False, fixtures=("pod_pair",), store=store,  # type: ignore[arg-type]
                   disks={"pa": 1, "pb": 1})
    return pair, closed


def test_every_pod_of_the_pair_is_killed_after_a_test_and_the_pair_kept(monkeypatch):
    guests = _Guests({"pa": ["ctr", "other"], "pb": ["blocker"]})
    pair, closed = _pair(monkeypatch, guests)
    pair.clean()
    assert sorted(guests.killed) == ["pa/ctr", "pa/other", "pb/blocker"]
    assert pair.store is not None and closed == []


def test_a_pod_that_will_not_die_sends_the_pair_away(monkeypatch):
    guests = _Guests({"pa": ["stuck"], "pb": []}, undying=frozenset({"stuck"}))
    pair, closed = _pair(monkeypatch, guests)
    with pytest.raises(PairNotClean, match="capsule 'pa' still has pods after the test"):
        pair.clean()
    assert pair.store is None and closed == ["domains", "store"]


def test_a_disk_left_on_a_capsule_sends_the_pair_away(monkeypatch):
    pair, closed = _pair(monkeypatch, _Guests({"pa": [], "pb": []}), disks=2)
    with pytest.raises(PairNotClean, match="2 disks after the test, 1 at its boot"):
        pair.clean()
    assert pair.store is None and closed == ["domains", "store"]


def test_a_pair_is_shut_down_after_the_last_test_that_asks_for_it(monkeypatch):
    closed: list[str] = []
    store = SimpleNamespace()
    pairs = {"p1": PodPair("a", "b", pod_network=False, fixtures=("p1", "p1_module"), store=store),  # type: ignore
             "p2": PodPair("c", "d", pod_network=True, fixtures=("p2",), store=store)}  # type: ignore[arg-type]

    def closer(name: str):
        return lambda: (closed.append(name), setattr(pairs[name], "store", None))

    for name, pair in pairs.items():
        monkeypatch.setattr(pair, "close", closer(name))
    monkeypatch.setattr(podpair, "PAIRS", pairs)
    items = [SimpleNamespace(fixturenames=names)
             for names in (["p1"], ["p2", "p1"], ["p1_module"], ["tmp_path"], ["p2"])]
    podpair.release_unneeded(items, 0)
    podpair.release_unneeded(items, 1)
    assert closed == []    # p1 is still asked for, by its other fixture
    podpair.release_unneeded(items, 2)
    assert closed == ["p1"]
    podpair.release_unneeded(items, 3)
    assert closed == ["p1"]
    podpair.release_unneeded(items, 4)
    assert closed == ["p1", "p2"]
