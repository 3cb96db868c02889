"""Shared fixtures: an image store built once per machine (tiny, and Debian
and the desktop on demand), fresh per-test stores that import those images, and clean-up of
every libvirt domain a test store started."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsule.agent.launch import AgentProcess, free_port  # noqa: F401 - free_port: for tests
from tests.tiers import check_tiers, no_processes

ROOT = Path(__file__).resolve().parent.parent
IMAGE_HOME = Path(os.environ.get("CAPSULE_TEST_IMAGES", ROOT / ".cache" / "test-images"))


def pytest_collection_modifyitems(config, items):
    check_tiers(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    yield from no_processes(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    yield from no_processes(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield from no_processes(item)


class _PassableTempPaths:
    """``tmp_path_factory`` (and so ``tmp_path``) whose directories QEMU, an unprivileged user, may pass
    through to a store in them (``guestaccess.let_pass``)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory

    def mktemp(self, basename: str, numbered: bool = True) -> Path:
        from capsule.runtime.guestaccess import let_pass

        path = self._factory.mktemp(basename, numbered)
        let_pass(path, Path(tempfile.gettempdir()))
        return path

    def __getattr__(self, name: str):
        return getattr(self._factory, name)


@pytest.fixture(scope="session")
def tmp_path_factory(tmp_path_factory: pytest.TempPathFactory) -> _PassableTempPaths:
    return _PassableTempPaths(tmp_path_factory)


def _image_store():
    from capsule.store import Store

    return Store.open(IMAGE_HOME)


def _ensure_image(store, kind: str) -> None:
    """Build the image once; again when the guest agent (or, in Debian, the pod layer) it carries is not
    the current one, or when the recipes (capsule/imagebuild/) changed."""
    from capsule import images
    from capsule.imagebuild.common import agent_binary, agent_info, pod_layer_sha256, recipe_sha256

    row = store.catalogue.image(kind)
    stale = row is not None and (row.info.get("agent_sha256") != agent_info(agent_binary())["sha256"]
                                 or row.info.get("recipe_sha256") != recipe_sha256()
                                 or (kind == "debian" and row.info.get("pods_sha256") != pod_layer_sha256()))
    images.build(store, kind, kind, rebuild=stale)


@pytest.fixture(scope="session")
def tiny_images():
    """The machine-wide test image store, with the tiny image built."""
    store = _image_store()
    _ensure_image(store, "tiny")
    return store


@pytest.fixture(scope="session")
def debian_images(tiny_images):
    _ensure_image(tiny_images, "debian")
    return tiny_images


@pytest.fixture(scope="session")
def desktop_images(tiny_images):
    """The test image store with the desktop image (the Debian guest plus a graphical session) built."""
    _ensure_image(tiny_images, "desktop")
    return tiny_images


def _destroy_domains(store) -> None:
    import libvirt

    from capsule.runtime.connection import connect

    conn = connect()
    for dom in conn.listAllDomains():
        if dom.name().startswith(f"capsule-{store.id}-"):
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()


def make_store(path: Path, source, *images_to_import: str):
    from capsule import images
    from capsule.store import Store

    store = Store.open(path)
    for name in images_to_import:
        images.import_image(source, store, name)
    return store


@pytest.fixture
def store(tmp_path, tiny_images) -> Iterator:
    """A fresh store holding the tiny image."""
    s = make_store(tmp_path / "store", tiny_images, "tiny")
    yield s
    _destroy_domains(s)
    s.close()


@pytest.fixture
def debian_store(tmp_path, debian_images) -> Iterator:
    s = make_store(tmp_path / "store", debian_images, "debian", "tiny")
    yield s
    _destroy_domains(s)
    s.close()


@pytest.fixture
def desktop_store(tmp_path, desktop_images) -> Iterator:
    s = make_store(tmp_path / "store", desktop_images, "desktop")
    yield s
    _destroy_domains(s)
    s.close()


class Agent(AgentProcess):
    """``capsule serve`` for one store, in its own process (capsule/agent/launch.py). stop() prints the
    agent's log, so a failing test shows the agent's side too."""

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        if text := self.log().strip():
            print(f"--- agent {self.url} log ---\n{text}")


@pytest.fixture
def two_hosts(request, tmp_path, tiny_images):
    """Hosts A and B: two stores (both holding the tiny image) and two agents on loopback, with plain HTTP,
    or with TLS (parametrize ``two_hosts`` indirectly with True: each agent's ``fingerprint`` is then what
    its clients pin)."""
    tls = getattr(request, "param", False)
    a = make_store(tmp_path / "a", tiny_images, "tiny")
    b = make_store(tmp_path / "b", tiny_images, "tiny")
    agent_a = Agent(a.home, tmp_path / "a.token", tls=tls)
    agent_b = Agent(b.home, tmp_path / "b.token", tls=tls)
    yield a, b, agent_a, agent_b
    for agent in (agent_a, agent_b):
        agent.stop()
    for s in (a, b):
        _destroy_domains(s)
        s.close()
