"""The pod tests' shared pairs of Debian capsules (tests/vm/podpair.py): each booted on the first test that asks
for it, cleaned after every test (after every module, for ``module_pod_pair``), shut down once no later test of
the session asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vm.podpair import PAIRS, PodPair, release_unneeded


@pytest.fixture(scope="session")
def _pod_pairs() -> Iterator[dict[str, PodPair]]:
    yield PAIRS
    for pair in PAIRS.values():
        pair.close()


def _pair(pair: PodPair, tmp_path_factory, debian_images) -> Iterator[PodPair]:
    if pair.store is None:
        pair.up(tmp_path_factory.mktemp(f"pod-pair-{pair.a}-{pair.b}"), debian_images)
    try:
        yield pair
    finally:
        pair.clean()


@pytest.fixture
def pod_pair(_pod_pairs, tmp_path_factory, debian_images) -> Iterator[PodPair]:
    """Capsules ``pa`` and ``pb``, running, not on the pod network, with no pods; shared by the session."""
    yield from _pair(_pod_pairs["pa"], tmp_path_factory, debian_images)


@pytest.fixture(scope="module")
def module_pod_pair(_pod_pairs, tmp_path_factory, debian_images) -> Iterator[PodPair]:
    """``pod_pair`` for a module whose tests each kill their own pods: made clean at the module's end only."""
    yield from _pair(_pod_pairs["pa"], tmp_path_factory, debian_images)


@pytest.fixture
def pod_network_pair(_pod_pairs, tmp_path_factory, debian_images) -> Iterator[PodPair]:
    """Capsules ``na`` and ``nb``, running, both on the host's pod network, with no pods; shared by the session."""
    yield from _pair(_pod_pairs["na"], tmp_path_factory, debian_images)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        items = item.session.items
        if item in items:
            release_unneeded(items, items.index(item))
