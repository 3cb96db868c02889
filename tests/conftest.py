"""Shared fixtures: an image store built once per machine (tiny, and Debian
and the desktop on demand), fresh per-test stores that import those images, and clean-up of
every libvirt domain a test store started (the helpers behind them: ``testkit.images``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsule.agent.launch import AgentProcess, free_port  # noqa: F401 - free_port: for tests
from testkit.images import destroy_domains, ensure_image, image_store, make_store
from tests.tiers import check_tiers, no_processes

# the compose hosts' fixtures (hosts, seeded, fresh), one definition for every tier
pytest_plugins = ["tests.helpers.composehosts"]


def _cli_consoles_without_a_fixed_width() -> None:
    """The CLI's consoles (``capsule.cli.common``) take COLUMNS as a fixed width if it is set when they are
    made, which in-process is whenever the first test imports the CLI (a CliRunner's ``env`` sets it for
    one call). Made here without it, they read COLUMNS on each call, whatever the order of the tests (it
    differs under pytest-xdist)."""
    saved = os.environ.pop("COLUMNS", None)
    import capsule.cli.common  # noqa: F401
    if saved is not None:
        os.environ["COLUMNS"] = saved


_cli_consoles_without_a_fixed_width()


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


@pytest.fixture(scope="session")
def tiny_images():
    """The machine-wide test image store, with the tiny image built."""
    store = image_store()
    ensure_image(store, "tiny")
    return store


@pytest.fixture(scope="session")
def debian_images(tiny_images):
    ensure_image(tiny_images, "debian")
    return tiny_images


@pytest.fixture(scope="session")
def desktop_images(tiny_images):
    """The test image store with the desktop image (the Debian guest plus a graphical session) built."""
    ensure_image(tiny_images, "desktop")
    return tiny_images


@pytest.fixture
def store(tmp_path, tiny_images) -> Iterator:
    """A fresh store holding the tiny image."""
    s = make_store(tmp_path / "store", tiny_images, "tiny")
    yield s
    destroy_domains(s)
    s.close()


@pytest.fixture
def debian_store(tmp_path, debian_images) -> Iterator:
    s = make_store(tmp_path / "store", debian_images, "debian", "tiny")
    yield s
    destroy_domains(s)
    s.close()


@pytest.fixture
def desktop_store(tmp_path, desktop_images) -> Iterator:
    s = make_store(tmp_path / "store", desktop_images, "desktop")
    yield s
    destroy_domains(s)
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
        destroy_domains(s)
        s.close()
